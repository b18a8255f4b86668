"""Expert imbalance in a plan. Under expert parallelism each MoE layer waits for its busiest
rank, which computes and receives ``1 / balancedness`` times the mean rows (balancedness: vLLM's
mean rank load over the largest). ``plan --balancedness B`` or ``--expert-distribution FILE``
says how uneven the routing is; with ``--enable-eplb`` or ``--ep-num-redundant-experts R`` the
balancedness after EPLB comes from our placement code (``core/eplb_placement.py``) run on that
load. The plan then times every MoE layer at the slowest rank (``Cluster.expert_imbalance``,
the mean over the layers of 1 / balancedness)."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from moe_overlap.core.eplb_placement import (
    AUTO,
    Algorithm,
    PlacementShape,
    balancedness,
    rebalance,
    trivial,
)
from moe_overlap.core.errors import ConfigError, is_finite_number
from moe_overlap.core.model_config import ModelConfig

SAMPLE_LAYERS = 2  # layers of synthetic load drawn for --balancedness


@dataclass(frozen=True)
class Imbalance:
    """The routing's balancedness on the trivial placement, and as planned (after EPLB where
    asked), each as one figure for all layers (``1 / mean(1 / B per layer)``)."""

    before: float
    planned: float
    eplb: bool

    @property
    def factor(self) -> float:
        """The busiest rank's rows over the mean: ``Cluster.expert_imbalance``."""
        return 1 / self.planned


def mean_balancedness(rows: list[list[int]], load: list[list[float]], gpus: int) -> float:
    """Per layer the balancedness of ``rows`` under ``load``, as one figure: the layers' mean
    slowest-rank factor, inverted (a forward takes the sum of its layers' slowest ranks)."""
    factors = [1 / balancedness(row, layer, gpus) for row, layer in zip(rows, load, strict=True)]
    return len(factors) / sum(factors)


def zipf_load(num_experts: int, exponent: float, layers: int, seed: int = 0) -> list[list[float]]:
    """``layers`` rows of Zipf load: the expert of rank r (a seeded order per layer) gets
    ``1 / (r + 1) ** exponent`` (``--expert-skew``'s routing)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(layers):
        order = list(range(num_experts))
        rng.shuffle(order)
        row = [0.0] * num_experts
        for rank, expert in enumerate(order):
            row[expert] = 1 / (rank + 1) ** exponent
        rows.append(row)
    return rows


def load_for(target: float, shape: PlacementShape) -> list[list[float]]:
    """Synthetic Zipf load whose trivial placement has balancedness ``target`` (bisection on
    the exponent over ``SAMPLE_LAYERS`` seeded layers)."""
    low, high = 0.0, 8.0
    placement = [trivial(shape)] * SAMPLE_LAYERS
    for _ in range(40):
        mid = (low + high) / 2
        got = mean_balancedness(
            placement, zipf_load(shape.num_experts, mid, SAMPLE_LAYERS), shape.num_gpus
        )
        low, high = (mid, high) if got > target else (low, mid)
    return zipf_load(shape.num_experts, (low + high) / 2, SAMPLE_LAYERS)


def plan_imbalance(
    shape: PlacementShape,
    target: float | None = None,
    load: list[list[float]] | None = None,
    eplb: bool = False,
    algorithm: Algorithm = AUTO,
) -> Imbalance:
    """The routing's balancedness given as ``target`` (a synthetic load made to match it) or
    as a recorded ``load``; ``eplb``: placed with DeepSeek's policy (the published one, not
    refined: what SGLang runs) on ``shape``'s slots."""
    if target is not None and not (is_finite_number(target) and 0 < target <= 1):
        raise ConfigError(f"--balancedness={target!r}: want a number in (0, 1] (1 is even)")
    if load is None:
        load = load_for(target, shape) if target is not None else [[1.0] * shape.num_experts]
    if any(len(row) != shape.num_experts for row in load):
        raise ConfigError(
            f"--expert-distribution: want {shape.num_experts} loads per layer (the model's experts)"
        )
    before = mean_balancedness([trivial(shape)] * len(load), load, shape.num_gpus)
    if target is not None:
        before = target  # what was asked, not the synthetic load's near match
    if not eplb:
        return Imbalance(before, before, False)
    placed = rebalance(load, shape, algorithm, refined=False)
    return Imbalance(before, mean_balancedness(placed, load, shape.num_gpus), True)


def placement_shape(
    cfg: ModelConfig, ep: int, redundant: int, gpus_per_node: int
) -> PlacementShape:
    """The placement a plan's layout implies: ``ep`` GPUs on as many whole nodes as they fill,
    the model's expert groups (the hierarchical policy packs them onto nodes)."""
    nodes = ep // gpus_per_node if ep >= gpus_per_node and ep % gpus_per_node == 0 else 1
    groups = cfg.n_group if cfg.n_group > 1 else None
    return PlacementShape(cfg.num_experts, cfg.num_experts + redundant, ep, nodes, groups)


@functools.cache
def eplb_imbalance(shape: PlacementShape, target: float) -> Imbalance:
    """``plan_imbalance`` with EPLB for routing of balancedness ``target`` (cached: the
    reproduce cases ask again for the same)."""
    return plan_imbalance(shape, target, eplb=True)
