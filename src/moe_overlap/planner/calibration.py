"""``--cluster this``: this machine's numbers, fitted from a short measured run.

The measurements (``planner/measurements.py`` names them, ``tools/measure_this.py`` runs them
over the engine's ranks and link) are no-overlap forwards of prefill and decode shapes, each
with its median wall time and its all-to-all spans, and decode pairs with and without two
micro-batches. The fit goes in steps, fixed costs first, so that no rate can buy a fixed cost
or the other way round:

1. the link: every all-to-all span, ``latency + bytes / rate``; and the routing, from the
   bytes each rank's dispatches sent and received: per layer the busiest rank's rows over the
   mean, the share of all routed rows each rank's experts got, and the bytes the all-to-alls
   carried over what those shares carry (per shape, and their median);
2. what each micro-batch after the first costs: per op, per active expert, and per DBO
   hand-over, from the pairs' measured extra less what the plan adds beyond these costs
   (agreement, latencies, the communication it hides), repeated until they settle;
3. the rates and the per-forward cost: every shape's wall less the plan's all-to-all time for
   it (with its own routing), over its features, which the planner
   gives on a unit cluster (GEMM FLOPs, attention FLOPs, cached keys read, prefill and decode
   sequence passes, 1).

Steps 1 and 3 are ``core/cost_fit.py``'s fit, the one ``--overlap auto`` calibrates with too:
non-negative, weighted by relative error (a 30 ms decode step counts as much as a 300 ms
prefill). Step 2 fits seconds, not ratios: its targets are differences that can be 0.
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.cost_fit import fit_costs, fit_link, nnls
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.planner.cluster import Cluster, overheads_us
from moe_overlap.planner.costs import CostModel
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.measurements import (
    DECODE_SHAPES,
    LONG,
    MID,
    PREFILL_SHAPES,
    TINY,
    TWO_PASSES,
    PassSample,
    Sample,
    expert_shares,
    imbalances,
)
from moe_overlap.planner.plan import Planner

HUGE = 1e15  # a rate that never limits
UNIT = Cluster(
    name="unit",
    nodes=1,
    gpus_per_node=1,
    gemm_tflops_bf16=HUGE,
    gemm_efficiency=1.0,
    attention_efficiency=1.0,
    hbm_gbps=HUGE,
    intra_node_a2a_gbps=HUGE,
    inter_node_a2a_gbps=HUGE,
    a2a_latency_us=0.0,
    attention_tflops=HUGE,
    activation_bytes=4,  # the engine's float32 rows
    attention_full_rectangle_with_prefix=True,
)


class UnitCost(TypedDict, total=False):
    """One compute cost of ``Cluster`` set to 1 second per unit (a FLOP, a byte, a pass)."""

    gemm_tflops_bf16: float
    attention_tflops: float
    kv_read_gbps: float
    seq_overhead_us: float
    decode_seq_overhead_us: float


UNITS = (  # each feature: the plan's seconds with one cost at 1 per unit, the rest free
    UnitCost(gemm_tflops_bf16=1e-12),
    UnitCost(attention_tflops=1e-12),
    UnitCost(kv_read_gbps=1e-9),
    UnitCost(seq_overhead_us=1e6),
    UnitCost(decode_seq_overhead_us=1e6),
)
# per-micro-batch overheads (op, expert, DBO switch), each alone at 1 s
UNIT_OVERHEADS = (
    overheads_us(1.0, 0.0, 0.0),
    overheads_us(0.0, 1.0, 0.0),
    overheads_us(0.0, 0.0, 1.0),
)


class LinkFields(TypedDict):
    """The link and routing part of a fitted ``Cluster`` (its fields of the same names)."""

    intra_node_a2a_gbps: float
    inter_node_a2a_gbps: float
    a2a_latency_us: float
    a2a_bytes_factor: float
    expert_shares: tuple[float, ...]
    expert_imbalance: float


def features(
    spec: ModelSpec, layout: PlanLayout, batch: ForwardBatch, imbalance: float = 1.0
) -> list[float]:
    """[GEMM FLOPs, attention FLOPs, KV bytes read, prefill and decode sequence passes], with
    every MoE layer's busiest rank computing ``imbalance`` times the mean rows."""
    row = []
    for unit in UNITS:
        cluster = dataclasses.replace(UNIT, nodes=layout.world, expert_imbalance=imbalance, **unit)
        planner = Planner(spec, cluster, layout)
        row.append(planner.plan(NONE.name, OverlapConfig(), [batch] * layout.world).seconds)
    return row


def fit_this_link(samples: list[Sample]) -> tuple[float, float]:
    """(latency seconds, bytes per second) from every all-to-all: time = lat + bytes / rate.
    Spans name their bytes in MB to two decimals: those under 0.1 MB are too coarse to use."""
    pairs = [t for s in samples for t in s.transfers if t[0] >= 0.1e6]
    if not pairs:
        raise ConfigError(
            "--cluster this: no all-to-all of 0.1 MB or more was measured, so the link cannot be "
            "fitted; use a model with a larger hidden size or more ranks"
        )
    link = fit_link(pairs)
    return link.latency_s, 1 / link.s_per_byte if link.s_per_byte > 0 else HUGE


def bytes_factors(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], shares: tuple[float, ...]
) -> list[float | None]:
    """Per sample, the bytes its all-to-alls carried over what routing by ``shares`` (even if
    none) would carry (each rank's link carries max(sent, received) rows, more than the mean
    when the model routes unevenly); None where its transfers are under 0.1 MB (named too
    coarsely to count)."""
    unit = dataclasses.replace(UNIT, nodes=layout.world, expert_shares=shares)
    costs = CostModel(spec, unit, layout)
    out: list[float | None] = []
    for s in samples:
        sizes = [b for b, _ in s.transfers if b >= 0.1e6]
        even = sum(costs.micro_batch([s.batch] * layout.world).a2a_bytes[0])
        out.append(sum(sizes) / len(sizes) / even if sizes and even > 0 else None)
    return out


def bytes_factor(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], shares: tuple[float, ...]
) -> float:
    """The routing's factor for a workload not measured: the median over the shapes."""
    ratios = [r for r in bytes_factors(spec, layout, samples, shares) if r is not None]
    return max(_median(ratios), 1e-3) if ratios else 1.0


def fit_cluster(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], passes: list[PassSample]
) -> Cluster:
    """This machine as a Cluster, fitted in the module's steps."""
    link = fit_link_fields(spec, layout, samples)
    return fit_overheads(spec, layout, passes, fit_compute(spec, layout, samples, link))


def fit_link_fields(spec: ModelSpec, layout: PlanLayout, samples: list[Sample]) -> LinkFields:
    """Step 1: the link and the routing."""
    latency, rate = fit_this_link(samples)
    shares = expert_shares(spec, samples, layout.world)
    _, typical_load = imbalances(spec, samples)
    return LinkFields(
        intra_node_a2a_gbps=rate / 1e9,
        inter_node_a2a_gbps=rate / 1e9,
        a2a_latency_us=latency * 1e6,
        a2a_bytes_factor=bytes_factor(spec, layout, samples, shares),
        expert_shares=shares,
        expert_imbalance=typical_load,
    )


def fit_compute(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], link: LinkFields
) -> Cluster:
    """Step 3: this machine with ``link`` and the compute costs fitted to each sample's wall
    less its all-to-alls (no per-micro-batch overheads yet)."""
    # the all-to-alls' time as the plan will time it, with each shape's own routing (its
    # measured bytes); the rest of the wall is compute, whatever the spans say (a rank late to
    # an all-to-all makes the other's span longer; the plan counts that as its compute)
    computes = []
    factors = bytes_factors(spec, layout, samples, link["expert_shares"])
    for s, factor in zip(samples, factors, strict=True):
        own = LinkFields(**link)
        own["a2a_bytes_factor"] = factor or link["a2a_bytes_factor"]
        link_only = Planner(spec, dataclasses.replace(UNIT, nodes=layout.world, **own), layout)
        comm = link_only.plan(NONE.name, OverlapConfig(), [s.batch] * layout.world).seconds
        computes.append(s.wall_s - comm)
    # each shape's experts as its own routing loaded them: with even loads the rates would take
    # on the routing's luck (docs/planner.md, Known limits: a layer waits for its busiest rank)
    loads, _ = imbalances(spec, samples)
    rows = [
        [*features(spec, layout, s.batch, load), 1.0]
        for s, load in zip(samples, loads, strict=True)
    ]
    costs = fit_costs(rows, computes, required=(0, 1))
    return _this_cluster(layout, link, costs)


def fit_overheads(
    spec: ModelSpec, layout: PlanLayout, passes: list[PassSample], fitted: Cluster
) -> Cluster:
    """Step 2, on the ``fitted`` rates of step 3: the per-micro-batch overheads, refitted
    until they settle; the Cluster with them."""
    kinds = {_key(p): p for p in passes}  # one pass per (mode, shape) stands for its repeats
    in_pair = [_pair_overhead_seconds(spec, layout, p) for p in kinds.values()]
    measured = [_median([p.two_s - p.none_s for p in passes if _key(p) == k]) for k in kinds]
    overheads = [0.0] * len(UNIT_OVERHEADS)
    for step in range(8):  # overheads: the measured extra less what the plan adds beyond them
        cluster = dataclasses.replace(fitted, **overheads_us(*overheads))
        beyond = [  # per pair: the plan's extra with the overheads taken out
            _two_minus_none(spec, cluster, layout, p) - _dot(overheads, units)
            for p, units in zip(kinds.values(), in_pair, strict=True)
        ]
        targets = [max(m - b, 0.0) for m, b in zip(measured, beyond, strict=True)]
        new = nnls(
            torch.tensor(in_pair, dtype=torch.float64), torch.tensor(targets, dtype=torch.float64)
        ).tolist()
        if step == 7 or all(
            abs(a - b) <= 1e-3 * max(b, 1e-4) for a, b in zip(new, overheads, strict=True)
        ):
            return cluster  # built with overheads the next step would keep
        overheads = new
    raise AssertionError("unreachable")


def _this_cluster(layout: PlanLayout, link: LinkFields, costs: list[float]) -> Cluster:
    """The Cluster of step 3's ``costs``: seconds per GEMM FLOP, attention FLOP, KV byte read,
    prefill and decode sequence pass, and per forward."""
    per_gemm, per_attn, per_kv, per_seq, per_dec, forward = costs
    return Cluster(
        name="this",
        description=f"this machine: {layout.world} ranks, calibrated by a short run",
        nodes=layout.world,
        gpus_per_node=1,
        gemm_tflops_bf16=1e-12 / max(per_gemm, 1e-18),
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        attention_tflops=1e-12 / max(per_attn, 1e-18),
        kv_read_gbps=1e-9 / max(per_kv, 1e-18),
        hbm_gbps=HUGE,
        seq_overhead_us=per_seq * 1e6,
        decode_seq_overhead_us=per_dec * 1e6,
        forward_overhead_us=forward * 1e6,
        activation_bytes=4,
        attention_full_rectangle_with_prefix=True,
        overheads_beyond_first=True,  # the first pass's fixed costs are in the fit above
        sources={"all": f"fitted: no-overlap prefill {PREFILL_SHAPES} and decode "
        f"{DECODE_SHAPES}, decode {TINY}, {MID} and {LONG} with and without two micro-batches"},
        **link,
    )  # fmt: skip


def _key(p: PassSample) -> tuple[str, int, int]:
    return (p.mode, p.batch.num_seqs, p.batch.prefix_lens[0])


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _overhead_seconds(
    spec: ModelSpec, layout: PlanLayout, batch: ForwardBatch, mode: str = NONE.name
) -> list[float]:
    """Per overhead in ``UNIT_OVERHEADS``, the plan's seconds with it at 1 s and all else free."""
    out = []
    for one in UNIT_OVERHEADS:
        cluster = dataclasses.replace(UNIT, nodes=layout.world, overheads_beyond_first=True, **one)
        cfg = TWO_PASSES[mode] if mode != NONE.name else OverlapConfig()
        out.append(Planner(spec, cluster, layout).plan(mode, cfg, [batch] * layout.world).seconds)
    return out


def _pair_overhead_seconds(spec: ModelSpec, layout: PlanLayout, p: PassSample) -> list[float]:
    two = _overhead_seconds(spec, layout, p.batch, p.mode)
    none = _overhead_seconds(spec, layout, p.batch)
    return [t - n for t, n in zip(two, none, strict=True)]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _two_minus_none(spec: ModelSpec, cluster: Cluster, layout: PlanLayout, p: PassSample) -> float:
    planner = Planner(spec, cluster, layout)
    batches = [p.batch] * layout.world
    two = planner.plan(p.mode, TWO_PASSES[p.mode], batches).seconds
    return two - planner.plan(NONE.name, OverlapConfig(), batches).seconds
