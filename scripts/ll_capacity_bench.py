"""Time the low-latency dispatch's decode under TBO and DBO at two capacities, in one run:
rank 0 of an emulated ep=8 (``bench --emulate-peers 8``), a decode of 256 sequences. Each
micro-batch holds 128 of them, so a capacity of 128 fits (the capacity bounds a micro-batch, as
DeepEP's bounds a dispatch call), and its fixed blocks are half those of a capacity of 256:
half the rows zeroed, copied and gathered each way.

    PYTHONPATH=src python scripts/ll_capacity_bench.py [CONFIG] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.workloads import make_batches, parse_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/qwen3-moe-tiny.json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    cfg = ModelConfig.from_hf(args.config)
    batches = make_batches(parse_workload("decode:256:512", 1), cfg.vocab_size, seed=0)
    engine = dict(config=cfg, emulate_peers=8, seed=0, max_num_seqs=256, max_model_len=600)
    with LLM(**engine, device=args.device, link="model:0.5gbit,20us") as llm:
        for mode in ("tbo", "dbo"):
            ms = {}
            for cap in (256, 128):
                overlap = replace(
                    OverlapConfig(mode),
                    a2a_mode="low_latency",
                    num_max_dispatch_tokens_per_rank=cap,
                )
                times = []
                for _ in range(args.repeat + 1):  # the first is a warm-up
                    start = time.perf_counter()
                    llm.executor.run(batches, overlap)
                    times.append(time.perf_counter() - start)
                ms[cap] = statistics.median(times[1:]) * 1e3
            print(
                f"{mode}: capacity 256 {ms[256]:.1f} ms, 128 {ms[128]:.1f} ms per forward "
                f"({ms[256] / ms[128]:.2f}x)"
            )


if __name__ == "__main__":
    main()
