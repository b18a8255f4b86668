#!/usr/bin/env bash
# Every GPU figure the README reports, in ONE device call of at most 8 minutes, on a machine
# with a GPU and torch already installed (nothing is installed; the package is read from src/).
#
# Usage: scripts/gpu_figures.sh OUT_DIR [STEPS]
#   STEPS: a comma list of attention,emulated,decode,decode-ll,decode-wait,paged,prefill,fp8,
#          gpu-check,spec-graphs,profile,device-ops (default all, in that order); they run in the order given, so a
#          lent session puts first what it most needs (decode-ll runs within decode)
#
# By default the emulated runs come first (they are what the overlap criteria judge), then the
# one-process forward, the GPU checks and last the profiles. Every step has its own `timeout`; a step that
# fails or times out is named in the summary and the run goes on, except a failed link
# calibration, which aborts (every later figure would be over a wrong link). Whatever ran is
# packed into at most 8 files under OUT_DIR (a device call returns no more):
#   summary.txt   each step's exit status and its figures' lines
#   logs.tgz      every step's whole log
#   gpu-check.txt the GPU checks' tail
# BUDGET (seconds, default 480) bounds the whole run: each step's limit is cut to what is left,
# and a step with under 20 s left is skipped and named, so the logs are always packed before the
# device call's own limit.
#
# Every step took about 760 s on an H200 (11-28), more than one call's 600 s; a lease of 900 s
# (its start-up about 50 s) holds two: `BUDGET=540 ... OUT
# gpu-check,emulated,decode,decode-ll,decode-wait,fp8,attention` (timeout_s 600), then at once,
# while the machine is warm, `BUDGET=230 ... OUT prefill,paged,profile` (timeout_s 260).
set -uo pipefail
out=${1:?usage: scripts/gpu_figures.sh OUT_DIR [STEPS]}
order=${2:-attention,emulated,decode,decode-ll,decode-wait,paged,prefill,fp8,gpu-check,spec-graphs,profile,device-ops}
steps=",$order,"
for s in ${order//,/ }; do
  case $s in
  attention | emulated | decode | decode-ll | decode-wait | paged | prefill | fp8 | gpu-check | \
    spec-graphs | profile | device-ops) ;;
  *)
    echo "gpu_figures.sh: unknown step '$s'" >&2
    exit 2
    ;;
  esac
done
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
py=${PY:-python3}
logs=$(mktemp -d)
summary="$out/summary.txt"
: > "$summary"
pack() { tar -czf "$out/logs.tgz" -C "$logs" . 2>/dev/null; }
trap pack EXIT
note() { echo "$*" | tee -a "$summary"; }
want() { [[ $steps == *",$1,"* ]]; }
# run NAME SECONDS CMD...: the command's whole output to logs/NAME.txt, its status to the summary
budget=${BUDGET:-480}
run() {
  local name=$1 limit=$2 rc
  shift 2
  local left=$((budget - SECONDS - 10))
  if ((left < 20)); then
    note "-- $name: skipped, the ${budget} s budget is spent"
    return 125
  fi
  ((limit > left)) && limit=$left
  local began=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$logs/$name.txt" 2>&1
  rc=$?
  note "-- $name: exit $rc in $((SECONDS - began)) s$([[ $rc == 124 ]] && echo " (timed out at ${limit} s)")"
  return $rc
}
cli=("$py" -c 'from moe_overlap.tools.cli import main; main()')
device=${DEVICE:-cuda}  # DEVICE=cpu CONFIG=configs/qwen3-moe-tiny.json: a smoke test on CPU

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' |
  tee -a "$summary"

# the 4-layer Qwen3-30B-A3B-shaped model every figure uses
cfg="$logs/qwen3-30b-a3b-4l.json"
"$py" - "$cfg" "${CONFIG:-configs/qwen3-30b-a3b.json}" <<'PY'
import json, sys
c = json.load(open(sys.argv[2]))
c["num_hidden_layers"] = 4
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
table() { grep -E "^[│┃┏┡└]|T_comp|limit|marked|refused" "$logs/$1.txt" >> "$summary"; }

# 1. overlap on one GPU: rank 0 of ep=8 (--emulate-peers 8), over a modelled link whose rate
#    makes T_comm ~ T_comp (one calibration run per workload, then the modes); decode-256 per
#    rank with the normal dispatch, then with the low-latency one (CUDA graphs where it can)
emulated=("${cli[@]}" bench --hf-config "$cfg" --device "$device" --dtype bfloat16 --emulate-peers 8)
# calibrate NAME WORKLOAD [,WAIT]: sets $bw, the modelled link's rate at which T_comm ~ T_comp
calibrate() {
  run "$1-probe" 90 "${emulated[@]}" --workload "$2" --modes none --repeat 3 \
    --link "model:400gbit,20us${3:-}" --json "$logs/$1-probe.json" || {
    note "link calibration for $2 failed: aborting (logs.tgz: $1-probe.txt)"
    exit 1
  }
  bw=$("$py" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("%.1fgbit" % (400 * r["t_comm_s"] / r["t_comp_s"]))' "$logs/$1-probe.json") || {
    note "link calibration for $2 wrote no rate: aborting"
    exit 1
  }
}
bw=400gbit profile_bw=400gbit decode_bw=50gbit
step_emulated() {
  for w in ${EMULATE_WORKLOADS:-single-long:3072 single-long:8192}; do
    name=emulate-${w//:/-}
    calibrate "$name" "$w"
    note "== emulated ep=8, $w, link model:$bw,20us"
    run "$name" 120 "${emulated[@]}" --workload "$w" --link "model:$bw,20us" --repeat 5 \
      --modes none,tbo+two-chunk,dbo,sbo
    table "$name"
    [[ $w == single-long:3072 ]] && profile_bw=$bw
  done
}
step_decode() {
  calibrate decode decode:256:512
  decode_bw=$bw
  note "== emulated ep=8, decode:256:512, link model:$bw,20us, normal dispatch"
  run decode 120 "${emulated[@]}" --workload decode:256:512 --link "model:$bw,20us" --repeat 10 \
    --modes none,tbo,sbo,dbo --a2a-mode normal
  table decode
  if want decode-ll; then
    note "== the same, low-latency dispatch"
    run decode-ll 120 "${emulated[@]}" --workload decode:256:512 --link "model:$bw,20us" --repeat 10 \
      --modes none,tbo,sbo,dbo --a2a-mode low_latency --num-max-dispatch-tokens-per-rank 256 \
      --cuda-graph-max-bs 256
    table decode-ll
    grep "CUDA graphs" "$logs/decode-ll.txt" >> "$summary"
    # the capacity bounds each micro-batch (SGLang's default 128): TBO's and DBO's halves of
    # 256 dispatch in blocks half the size; none (256 rows) takes the normal dispatch, eagerly
    note "== the same, --a2a-mode auto, capacity 128 (low-latency for each micro-batch of 128)"
    run decode-ll-128 120 "${emulated[@]}" --workload decode:256:512 --link "model:$bw,20us" \
      --repeat 10 --modes none,tbo,dbo --a2a-mode auto --num-max-dispatch-tokens-per-rank 128 \
      --cuda-graph-max-bs 256
    table decode-ll-128
    grep "CUDA graphs" "$logs/decode-ll-128.txt" >> "$summary"
    # SGLang's staggered decode stages record micro-batch 1's dispatch behind micro-batch 0's
    # combine wait (2 of 4 transfers a layer exposed, 2.3 of 4.6 ms on 11-28); ours in lockstep
    note "== the same, --tbo-decode-order lockstep"
    run decode-ll-128-lockstep 120 "${emulated[@]}" --workload decode:256:512 \
      --link "model:$bw,20us" --repeat 10 --modes none,tbo --a2a-mode auto \
      --num-max-dispatch-tokens-per-rank 128 --cuda-graph-max-bs 256 --tbo-decode-order lockstep
    table decode-ll-128-lockstep
  fi
}

# 1a. why TBO loses at decode-256 where DBO pays: capacity 128 again, with the link's holds as a
#     kernel spinning on the GPU clock (no host-function wake-up per transfer, which TBO's and
#     DBO's twice as many transfers pay twice), then with no link (what the two micro-batches
#     cost by themselves)
step_decode_wait() {
  local ll=(--workload decode:256:512 --repeat 10 --modes none,tbo,dbo --a2a-mode auto
    --num-max-dispatch-tokens-per-rank 128 --cuda-graph-max-bs 256)
  calibrate decode-spin decode:256:512 ,globaltimer
  note "== emulated ep=8, decode:256:512, auto, capacity 128, link model:$bw,20us,globaltimer"
  run decode-ll-128-spin 120 "${emulated[@]}" "${ll[@]}" --link "model:$bw,20us,globaltimer"
  table decode-ll-128-spin
  note "== the same, no link"
  run decode-ll-128-nolink 120 "${emulated[@]}" "${ll[@]}" --link none
  table decode-ll-128-nolink
}

# 1b. decode-256 from CUDA graphs on KV pages of 16 against one page per sequence (the
#     whole-context slot's layout) and pages read in place by FlexAttention, one process
step_paged() {
  note "== decode-256 on pages against whole-context slots (scripts/paged_decode_bench.py)"
  run paged 240 "$py" scripts/paged_decode_bench.py "$cfg" 256 512 64
  grep -E "^(==|pages|one page| +pages| +one page)" "$logs/paged.txt" >> "$summary"
}

# 1c. attention after a prefix (TBO's second chunk, chunked prefill, prefix hits, verify steps):
#     the engine's lower-right causal bias against the boolean mask it passed before, bf16
step_attention() {
  run attention 60 "$py" scripts/prefix_attention_bench.py
  grep -E "^==|x$|refused" "$logs/attention.txt" >> "$summary"
}

# 2. the one-process forward (ep=1, no link)
step_prefill() {
  run prefill 90 "${cli[@]}" bench --hf-config "$cfg" --device "$device" --ep 1 --dtype bfloat16 \
    --link none \
    --repeat 10 --workload single-long:3072 --modes none
  table prefill
}

# 2b. an FP8 checkpoint (Hub layout, 128x128 blocks) of the same shape, 2 layers (make-model
#     stays cheap): decode-64 and prefill-3072 against bf16 random weights of that shape, ep=1,
#     then the same checkpoint dequantized at each use (--fp8-dequant-on-the-fly: no W8A8, the
#     reference the W8A8 linears and grouped expert kernel are judged against); the bench's header
#     says which FP8 path ran (W8A8 or dequantized) and the resident bytes
step_fp8() {
  cfg2="$logs/qwen3-30b-a3b-2l.json"
  "$py" -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = 2
json.dump(c, open(sys.argv[2], "w"))' "$cfg" "$cfg2"
  run fp8-probe 40 "$py" scripts/fp8_layout_probe.py
  grep -E "^[0-9]+x|engine takes" "$logs/fp8-probe.txt" >> "$summary"
  run fp8-model 120 "${cli[@]}" make-model --hf-config "$cfg2" --out "$logs/fp8-model" \
    --quantize fp8
  for w in decode:64:512 single-long:3072; do
    note "== one process, $w: bf16 weights, then the FP8 checkpoint"
    run "bf16-${w//:/-}" 60 "${cli[@]}" bench --hf-config "$cfg2" --device "$device" --ep 1 \
      --dtype bfloat16 --link none --repeat 10 --workload "$w" --modes none
    table "bf16-${w//:/-}"
    run "fp8-${w//:/-}" 60 "${cli[@]}" bench --model "$logs/fp8-model" --device "$device" \
      --ep 1 --dtype bfloat16 --link none --repeat 10 --workload "$w" --modes none
    table "fp8-${w//:/-}"
    grep -iE "fp8|w8a8|resident" "$logs/fp8-${w//:/-}.txt" >> "$summary"
    run "fp8-dequant-${w//:/-}" 60 "${cli[@]}" bench --model "$logs/fp8-model" \
      --device "$device" --ep 1 --dtype bfloat16 --fp8-dequant-on-the-fly --link none \
      --repeat 10 --workload "$w" --modes none
    table "fp8-dequant-${w//:/-}"
  done
  # the references' scenario: FP8 experts and FP8 dispatch at decode (the dispatch's rows go
  # into the W8A8 kernel as they arrived), against the run dtype's dispatch, in one bench
  note "== emulated ep=8, FP8 checkpoint, decode:256:512, auto/capacity 128, FP8 dispatch" \
    "against the run dtype's, link model:$decode_bw,20us"
  run fp8-dispatch 150 "${cli[@]}" bench --model "$logs/fp8-model" --device "$device" \
    --dtype bfloat16 --emulate-peers 8 --workload decode:256:512 --link "model:$decode_bw,20us" \
    --repeat 5 --modes none,tbo,dbo --a2a-mode auto --num-max-dispatch-tokens-per-rank 128 \
    --cuda-graph-max-bs 256 --moe-dispatch-dtype fp8 --compare-dispatch-dtype
  table fp8-dispatch
  grep -iE "w8a8|dispatch fp8" "$logs/fp8-dispatch.txt" >> "$summary"
  rm -rf "$logs/fp8-model"
}

# 3. the GPU checks (tests/gpu), before the diagnostics
step_gpu_check() {
  run gpu-check 300 "$py" -m pytest tests/gpu -q -rs
  tail -40 "$logs/gpu-check.txt" > "$out/gpu-check.txt"
}

# 3b. greedy decode under speculation with and without CUDA graphs (the verify steps' graphs,
#     and MTP's draft-step graphs), against plain decode with and without them, one process:
#     n-gram drafts on the 4-layer model, MTP drafts on the tiny DeepSeek-V3 (one MTP layer)
step_spec_graphs() {
  note "== speculative decode, CUDA graphs against eager (scripts/spec_graph_bench.py)"
  run spec-graphs-ngram 90 "$py" scripts/spec_graph_bench.py "$cfg" NGRAM 1,8,32 64
  grep -E "^(==|batch|graphs captured)" "$logs/spec-graphs-ngram.txt" >> "$summary"
  run spec-graphs-mtp 100 "$py" scripts/spec_graph_bench.py configs/deepseek-v3-tiny.json EAGLE \
    1,8,32 64
  grep -E "^(==|batch|graphs captured)" "$logs/spec-graphs-mtp.txt" >> "$summary"
}

# 4. where the emulated forward's host time goes, per mode (its waits for the device among
#    them), and the device operations the same forward issues, counted on meta
step_profile() {
  run emulate-profile 120 "$py" scripts/emulate_profile.py "$cfg" single-long:3072 \
    "model:$profile_bw,20us" none,tbo+two-chunk,dbo,sbo
  grep -E "^==|cuda(StreamSynchronize|MemcpyAsync|EventSynchronize)" \
    "$logs/emulate-profile.txt" >> "$summary"
  # decode-256 at capacity 128 from graphs: whether TBO's two micro-batches cost more kernel
  # time than one batch of 256 (latency-bound kernels), where DBO's streams run them at once
  run emulate-profile-decode 120 "$py" scripts/emulate_profile.py "$cfg" decode:256:512 \
    "model:$decode_bw,20us" none,tbo,dbo --a2a-mode auto --capacity 128 --cuda-graph-max-bs 256
  grep -E "^==|cuda(StreamSynchronize|MemcpyAsync|EventSynchronize)" \
    "$logs/emulate-profile-decode.txt" >> "$summary"
}
step_device_ops() {
  run device-ops 60 "$py" scripts/device_ops.py "$cfg" --emulate-peers 8 --prefill 3072
  grep overlap "$logs/device-ops.txt" >> "$summary"
}

for s in ${order//,/ }; do
  [[ $s == decode-ll ]] || "step_${s//-/_}"
done
