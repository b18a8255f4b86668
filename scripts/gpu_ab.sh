#!/usr/bin/env bash
# One-off A/B on a GPU: where TBO's prefill overlap goes (no link; deferred send off; a kernel
# hold instead of a host function), at single-long:8192 over the calibrated link.
set -uo pipefail
out=${1:?OUT}; bw=${2:-623.2gbit}
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
mkdir -p "$out"; log="$out/ab.txt"; : > "$log"
python3 - /tmp/cfg.json <<'PY'
import json, sys
c = json.load(open("configs/qwen3-30b-a3b.json")); c["num_hidden_layers"] = 4
json.dump(c, open(sys.argv[1], "w"))
PY
b() { echo "== $*" >> "$log"; timeout 90 python3 -c 'from moe_overlap.tools.cli import main; main()' bench \
  --hf-config /tmp/cfg.json --device cuda --dtype bfloat16 --emulate-peers 8 --repeat 5 "$@" 2>&1 |
  grep -E "^[│┃]|T_comp" >> "$log"; }
m=none,tbo+two-chunk,sbo
b --workload single-long:8192 --link none --modes $m,tbo
b --workload single-long:8192 --link model:$bw,20us --modes $m
cp src/moe_overlap/dispatch/all_to_all.py /tmp/a2a.py
sed -i 's/self.defer_send = self.comm.on_gpu/self.defer_send = False/' src/moe_overlap/dispatch/all_to_all.py
echo "-- defer_send=False" >> "$log"
b --workload single-long:8192 --link model:$bw,20us --modes $m
cp /tmp/a2a.py src/moe_overlap/dispatch/all_to_all.py
cp src/moe_overlap/distributed/streams.py /tmp/streams.py
sed -i 's/hold_stream(seconds, self.device)/hold_stream(seconds, self.device, "globaltimer")/' src/moe_overlap/distributed/streams.py
echo "-- hold by a globaltimer kernel" >> "$log"
b --workload single-long:8192 --link model:$bw,20us --modes $m
cp /tmp/streams.py src/moe_overlap/distributed/streams.py
timeout 60 python3 -m pytest tests/gpu/test_emulate_cuda.py -q -s 2>&1 | tail -15 >> "$log"
cat "$log"
