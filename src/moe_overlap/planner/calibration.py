"""``--cluster this``: this machine's numbers, fitted from a short measured run.

The measurements (``tools/plan_cli.py`` runs them over the engine's ranks and link) are
no-overlap forwards of a few shapes, each with its wall time and its all-to-all spans. The
features of each shape come from the planner itself: the same simulated forward on a unit
cluster (one FLOP per second, no other cost) gives its GEMM FLOPs, and likewise its attention
FLOPs, its op count and its attention sequence count. A least-squares fit of the measured
compute time (wall minus all-to-all time) over those features gives the rates and overheads;
the spans give the link's latency and rate. One more measurement, a tiny batch with and
without two micro-batches, splits the fixed cost between each op pass and the forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.planner.cluster import Cluster
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.plan import Planner

SHAPES = ((1, 256), (1, 1024), (1, 2048), (2, 1024), (32, 8))  # (sequences, tokens each)
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
    attention_full_rectangle_with_prefix=True,
)


@dataclass(frozen=True)
class Sample:
    """One measured no-overlap forward: every rank ran ``batch``."""

    batch: ForwardBatch
    wall_s: float
    comm_s: float  # the slowest rank's all-to-all time in it
    transfers: tuple[tuple[float, float], ...]  # (bytes, seconds) of its all-to-alls


def shape_batch(seqs: int, tokens: int) -> ForwardBatch:
    return ForwardBatch(
        torch.zeros(seqs * tokens, dtype=torch.long), list(range(seqs)), [0] * seqs, [tokens] * seqs
    )


def features(spec: ModelSpec, layout: PlanLayout, batch: ForwardBatch) -> list[float]:
    """[GEMM FLOPs, attention FLOPs, op calls, attention sequence passes, 1] of one forward."""
    units = (
        dict(gemm_tflops_bf16=1e-12),
        dict(attention_tflops=1e-12),
        dict(op_overhead_us=1e6),
        dict(seq_overhead_us=1e6),
    )
    row = []
    for unit in units:
        cluster = dataclasses.replace(UNIT, nodes=layout.world, **unit)
        planner = Planner(spec, cluster, layout)
        row.append(planner.plan("none", OverlapConfig(), [batch] * layout.world).seconds)
    return [*row, 1.0]


def fit_link(samples: list[Sample]) -> tuple[float, float]:
    """(latency seconds, bytes per second) from every all-to-all: time = lat + bytes / rate."""
    pairs = [t for s in samples for t in s.transfers if t[0] > 0]
    x = torch.tensor([[1.0, b] for b, _ in pairs], dtype=torch.float64)
    y = torch.tensor([d for _, d in pairs], dtype=torch.float64)[:, None]
    scale = x.abs().amax(dim=0)
    latency, per_byte = (torch.linalg.lstsq(x / scale, y).solution[:, 0] / scale).tolist()
    return max(latency, 0.0), 1 / per_byte if per_byte > 0 else HUGE


def fit_cluster(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], extra_pass_s: float
) -> Cluster:
    """This machine as a Cluster. ``extra_pass_s``: measured cost of one more micro-batch pass
    through every op of a tiny batch (its agreement and all-to-alls' latency taken out)."""
    rows = [features(spec, layout, s.batch) for s in samples]
    ops = rows[0][2]  # the same op count in every shape: it cannot be told from the constant
    x = torch.tensor([[r[0], r[1], r[3], r[4]] for r in rows], dtype=torch.float64)
    y = torch.tensor([s.wall_s - s.comm_s for s in samples], dtype=torch.float64)[:, None]
    scale = x.abs().amax(dim=0).clamp_min(1e-30)
    solution = torch.linalg.lstsq(x / scale, y).solution[:, 0] / scale
    per_gemm, per_attn, per_seq, fixed = solution.tolist()
    fixed = max(fixed, 0.0)
    per_op = min(extra_pass_s, fixed) / ops if extra_pass_s > 0 else fixed / ops
    forward = max(fixed - per_op * ops, 0.0)  # rounding may leave a hair below zero
    latency, rate = fit_link(samples)
    return Cluster(
        name="this",
        description=f"this machine: {layout.world} ranks, calibrated by a short run",
        nodes=layout.world,
        gpus_per_node=1,
        gemm_tflops_bf16=1e-12 / max(per_gemm, 1e-18),
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        attention_tflops=1e-12 / max(per_attn, 1e-18),
        hbm_gbps=HUGE,
        intra_node_a2a_gbps=rate / 1e9,
        inter_node_a2a_gbps=rate / 1e9,
        a2a_latency_us=latency * 1e6,
        op_overhead_us=per_op * 1e6,
        seq_overhead_us=max(per_seq, 0.0) * 1e6,
        forward_overhead_us=forward * 1e6,
        activation_bytes=4,
        attention_full_rectangle_with_prefix=True,
        sources={"all": "fitted from no-overlap forwards of " + ", ".join(map(str, SHAPES))},
    )
