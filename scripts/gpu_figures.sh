#!/usr/bin/env bash
# Every GPU figure the README reports, in one run on a machine with a GPU and torch installed
# (nothing is installed; the package is read from src/). Usage: scripts/gpu_figures.sh OUT_DIR
# Writes OUT_DIR/{gpu-check,bench-*,profile/*}.txt and prints a summary.
set -u
out=${1:?usage: scripts/gpu_figures.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=src
py=${PY:-python3}
cli() { "$py" -c 'from moe_overlap.tools.cli import main; main()' "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"

# 1. the GPU checks (tests/gpu)
"$py" -m pytest tests/gpu -q -rs 2>&1 | tail -40 | tee "$out/gpu-check.txt"

# 2. the 4-layer Qwen3-30B-A3B-shaped bf16 forward, one process
cfg="$out/qwen3-30b-a3b-4l.json"
"$py" - "$cfg" <<'PY'
import json, sys
c = json.load(open("configs/qwen3-30b-a3b.json"))
c["num_hidden_layers"] = 4
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
bench() {
  cli bench --hf-config "$cfg" --device cuda --ep 1 --dtype bfloat16 --link none --repeat 5 "$@"
}
bench --workload decode:64:512 --modes none,tbo 2>&1 | tail -14 | tee "$out/bench-decode.txt"
bench --workload decode:64:512 --modes none,tbo --disable-cuda-graph 2>&1 | tail -14 |
  tee "$out/bench-decode-eager.txt"
bench --workload single-long:3072 --modes none,tbo 2>&1 | tail -14 | tee "$out/bench-prefill.txt"

# 3. one decode and one prefill step under the profiler: host syncs and kernel time
"$py" scripts/gpu_step_profile.py "$cfg" "$out/profile" cuda 2>&1 | tail -30
for k in decode prefill; do
  echo "== $k step: syncs and top ops"
  grep -E "cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|Self CPU time total|Self CUDA time total" \
    "$out/profile/step-$k.txt"
done 2>&1 | tee "$out/profile-summary.txt"
