"""What cutting one prompt in two (two-chunk's pieces) costs in compute on one process, no overlap:
the prompt whole against its two pieces one after the other, best of three each.

    PYTHONPATH=src python scripts/cut_cost.py [CONFIG ...]   (default: the Qwen3.5 and Qwen3 bench
    configs)
"""

from __future__ import annotations

import sys
import time

import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.split import plan_two_batch, split_batch
from moe_overlap.runtime.model_runner import ModelRunner

CONFIGS = ["configs/qwen3_5-moe-bench.json", "configs/qwen3-moe-bench.json"]
TOKENS = 3072


def best_of_three(runner: ModelRunner, batches: list[ForwardBatch]) -> float:
    """The best of three runs of ``batches``, one forward each, in turn."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for batch in batches:
            runner.forward_plain(batch)
        times.append(time.perf_counter() - start)
    return min(times)


def main(configs: list[str]) -> None:
    for name in configs:
        cfg = ModelConfig.from_hf(name)
        model = build_model(cfg, seed=0)
        runner = ModelRunner(model, LocalDispatcher(cfg.num_experts), num_slots=2, max_len=4096)
        ids = torch.randint(cfg.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(0))
        whole = ForwardBatch(ids, [0], [0], [TOKENS])
        first, second = split_batch(whole, plan_two_batch(whole, 0.48))
        with torch.inference_mode():
            t_whole = best_of_three(runner, [whole])
            t_cut = best_of_three(runner, [first, second])
        print(
            f"{name}: whole {t_whole * 1e3:.0f} ms, two pieces in turn {t_cut * 1e3:.0f} ms "
            f"({(t_cut / t_whole - 1) * 100:+.1f}%)"
        )


if __name__ == "__main__":
    main(sys.argv[1:] or CONFIGS)
