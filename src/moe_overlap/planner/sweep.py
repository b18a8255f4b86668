"""Where overlap starts to pay in decode: each mode's predicted time by decode batch size.

The answer is the batch size (tokens per rank) to give DBO's ``--dbo-decode-token-threshold``
on a cluster: below it the extra micro-batch pass (weights read again, op overheads) costs more
than the all-to-all time it hides. Thresholds are lowered for the sweep so every overlapped
mode really splits, whatever its default would decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.planner.plan import Planner

SIZES = tuple(2**i for i in range(11))  # 1 .. 1024 sequences per DP group


@dataclass
class SweepPoint:
    batch_size: int
    seconds: dict[str, float]  # per mode, predicted ms-scale forward time in seconds

    def speedup(self, mode: str) -> float:
        return self.seconds[NONE.name] / self.seconds[mode]


def always_split(cfg: OverlapConfig) -> OverlapConfig:
    """``cfg`` with the vote thresholds at their floor: the sweep measures the split itself."""
    return dataclasses.replace(cfg, tbo_min_tokens=1, dbo_decode_token_threshold=1)


def decode_sweep(
    planner: Planner,
    configs: dict[str, OverlapConfig],
    batches_for: Callable[[int], list[ForwardBatch]],
    sizes: tuple[int, ...] = SIZES,
) -> list[SweepPoint]:
    """Every mode's predicted forward at each decode batch size (``batches_for(bs)``: the
    ranks' batches)."""
    configs = {m: always_split(c) for m, c in configs.items()}
    return [_point(planner, configs, batches_for, bs) for bs in sizes]


def _point(planner, configs, batches_for, bs: int) -> SweepPoint:
    batches = batches_for(bs)
    return SweepPoint(bs, {m: planner.plan(m, c, batches).seconds for m, c in configs.items()})


def crossover(
    planner: Planner,
    configs: dict[str, OverlapConfig],
    batches_for: Callable[[int], list[ForwardBatch]],
    points: list[SweepPoint],
    mode: str,
) -> int | None:
    """The smallest batch size from which ``mode`` beats none at every larger swept size,
    found exactly by bisection between the swept sizes; None if it never does."""
    configs = {NONE.name: always_split(configs[NONE.name]), mode: always_split(configs[mode])}
    wins = [p.speedup(mode) > 1 for p in points]
    if not wins[-1]:
        return None
    first = len(wins) - 1
    while first > 0 and wins[first - 1]:
        first -= 1
    if first == 0:
        return points[0].batch_size
    lo, hi = points[first - 1].batch_size, points[first].batch_size  # loses at lo, wins at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _point(planner, configs, batches_for, mid).speedup(mode) > 1:
            hi = mid
        else:
            lo = mid
    return hi
