"""Profile one forward per mode of ``bench --emulate-peers`` on a GPU: host time, kernel time
(the sum of every kernel's, which exceeds the wall time where streams run kernels at once) and
where the host waits for the device.

Usage: PYTHONPATH=src python scripts/emulate_profile.py CONFIG_JSON WORKLOAD LINK [MODES]
       [--a2a-mode auto|normal|low_latency] [--capacity N] [--cuda-graph-max-bs N]
e.g. ... configs/qwen3-30b-a3b.json single-long:3072 model:800gbit,20us none,tbo
     ... configs/qwen3-30b-a3b.json decode:256:512 model:50gbit,20us none,tbo,dbo \\
         --a2a-mode auto --capacity 128 --cuda-graph-max-bs 256
"""

import argparse
import dataclasses
import time

import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.workloads import Workload, make_batches, parse_workload
from moe_overlap.tools.bench import step

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("config")
parser.add_argument("workload")
parser.add_argument("link")
parser.add_argument("modes", nargs="?", default="none,tbo")
parser.add_argument("--a2a-mode", default="auto")
parser.add_argument("--capacity", type=int, default=128, help="--num-max-dispatch-tokens-per-rank")
parser.add_argument("--cuda-graph-max-bs", type=int, default=64)
args = parser.parse_args()
PEERS = 8
cfg = ModelConfig.from_hf(args.config)
w = parse_workload(args.workload, PEERS, seed=0)
rank0 = Workload(w.spec, w.lengths[:1])
batches = make_batches(rank0, cfg.vocab_size, 0)
kw = dict(device="cuda", dtype="bfloat16", link=args.link, emulate_peers=PEERS)
WAITS = (
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
)
dispatch = dict(a2a_mode=args.a2a_mode, num_max_dispatch_tokens_per_rank=args.capacity)
max_len = max(max(x) for x in w.lengths) + 8
with LLM(config=cfg, max_model_len=max_len, cuda_graph_max_bs=args.cuda_graph_max_bs, **kw) as llm:
    for mode in args.modes.split(","):
        overlap = dataclasses.replace(mode_config(mode), **dispatch)
        for _ in range(3):  # warm-up: the graphs are captured here
            step(llm.executor, batches, overlap)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            step(llm.executor, batches, overlap)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        cpu = sum(e.self_cpu_time_total for e in events) / 1e3
        gpu = sum(e.self_device_time_total for e in events) / 1e3
        print(f"== {mode}: wall {wall * 1e3:.1f} ms, host {cpu:.1f} ms, kernels {gpu:.1f} ms")
        for e in events:
            if e.key in WAITS:
                print(f"   {e.key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.2f} ms")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12))
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))
