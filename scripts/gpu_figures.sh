#!/usr/bin/env bash
# Every GPU figure the README reports, in one run on a machine with a GPU and torch installed
# (nothing is installed; the package is read from src/). Usage: scripts/gpu_figures.sh OUT_DIR
# Writes OUT_DIR/{gpu-check,bench-*,profile/*,emulate-*,device-ops}.txt and prints a summary.
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

# 4. overlap on one GPU: rank 0 of ep=8 (--emulate-peers 8), over a modelled link whose bandwidth
#    is chosen so that T_comm ~ T_comp (one calibration run, then every mode)
emulated() {
  cli bench --hf-config "$cfg" --device cuda --dtype bfloat16 --emulate-peers 8 "$@"
}
for w in ${EMULATE_WORKLOADS:-single-long:3072}; do
  name=${w//:/-}
  emulated --workload "$w" --modes none --repeat 3 --link model:400gbit,20us \
    --json "$out/emulate-$name-probe.json" > /dev/null 2>&1
  bw=$("$py" - "$out/emulate-$name-probe.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"{400 * r['t_comm_s'] / r['t_comp_s']:.1f}gbit")  # the rate at which T_comm = T_comp
PY
)
  echo "== emulated ep=8, $w, link model:$bw,20us"
  emulated --workload "$w" --link "model:$bw,20us" --repeat 5 \
    --modes none,sbo,dbo,tbo,tbo+two-chunk,tbo+time-split,tbo3+time-split 2>&1 | tail -24 |
    tee "$out/emulate-$name.txt"
done

# 5. where the emulated forward's host time goes, per mode (the host's waits in the counts'
#    copies among them), and the device operations the same forward issues, counted on meta
"$py" scripts/emulate_profile.py "$cfg" single-long:3072 "model:${bw:-400gbit},20us" \
  none,tbo,sbo 2>&1 | grep -E "^==|cuda(StreamSynchronize|MemcpyAsync|EventSynchronize)" |
  tee "$out/emulate-profile.txt"
"$py" scripts/device_ops.py "$cfg" --emulate-peers 8 --prefill 3072 2>&1 | grep overlap |
  tee "$out/device-ops.txt"
