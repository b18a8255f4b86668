"""Profile one forward per mode of ``bench --emulate-peers`` on a GPU: host time, kernel time
and where the host waits for the device.

Usage: PYTHONPATH=src python scripts/emulate_profile.py CONFIG_JSON WORKLOAD LINK [MODES]
e.g. ... configs/qwen3-30b-a3b.json single-long:3072 model:800gbit,20us none,tbo
"""

import sys
import time

import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.workloads import Workload, make_batches, parse_workload
from moe_overlap.tools.bench import step

config, spec, link = sys.argv[1:4]
modes = (sys.argv[4] if len(sys.argv) > 4 else "none,tbo").split(",")
PEERS = 8
cfg = ModelConfig.from_hf(config)
w = parse_workload(spec, PEERS, seed=0)
rank0 = Workload(w.spec, w.lengths[:1])
batches = make_batches(rank0, cfg.vocab_size, 0)
kw = dict(device="cuda", dtype="bfloat16", link=link, emulate_peers=PEERS)
WAITS = (
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaEventSynchronize",
    "cudaDeviceSynchronize",
)
with LLM(config=cfg, max_model_len=max(max(x) for x in w.lengths) + 8, **kw) as llm:
    for mode in modes:
        overlap = mode_config(mode)
        for _ in range(3):
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
