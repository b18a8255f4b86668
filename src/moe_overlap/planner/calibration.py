"""``--cluster this``: this machine's numbers, fitted from a short measured run.

The measurements (``tools/plan_cli.py`` runs them over the engine's ranks and link) are
no-overlap forwards of prefill and decode shapes, each with its median wall time and its
all-to-all spans, and tiny forwards with and without two micro-batches. The fit goes in steps,
fixed costs first, so that no rate can buy a fixed cost or the other way round:

1. the link: every all-to-all span, ``latency + bytes / rate``;
2. one more micro-batch pass (its op overheads): the tiny pairs' difference, less what the
   plan itself says the second pass costs beyond its overheads (agreement, latencies);
3. the rates and the per-forward cost: the compute time of every shape (wall less all-to-all,
   less one pass) over its features, which the planner gives on a unit cluster (GEMM FLOPs,
   attention FLOPs, cached keys read, prefill and decode sequence passes, 1).

Fits are non-negative and weighted by relative error: a 30 ms decode step counts as much as a
300 ms prefill.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.planner.cluster import Cluster
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.plan import Planner

PREFILL_SHAPES = ((1, 256), (1, 1024), (1, 2048), (2, 1024), (32, 8))  # (sequences, tokens)
DECODE_SHAPES = ((2, 16), (4, 512), (16, 256), (64, 128), (64, 384), (32, 512))  # (seqs, context)
TINY = (2, 16)  # the decode shape whose second pass is measured
TWO_PASSES = OverlapConfig("tbo")  # splits TINY 1 + 1
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
UNITS = (  # each feature: the plan's seconds with one cost at 1 per unit, the rest free
    dict(gemm_tflops_bf16=1e-12),
    dict(attention_tflops=1e-12),
    dict(kv_read_gbps=1e-9),
    dict(seq_overhead_us=1e6),
    dict(decode_seq_overhead_us=1e6),
)


@dataclass(frozen=True)
class Sample:
    """One measured no-overlap forward: every rank ran ``batch``."""

    batch: ForwardBatch
    wall_s: float
    comm_s: float  # the slowest rank's all-to-all time in it
    transfers: tuple[tuple[float, float], ...] = ()  # (bytes, seconds) of its all-to-alls


@dataclass(frozen=True)
class PassSample:
    """The tiny batch's median walls with no overlap and with two micro-batches."""

    batch: ForwardBatch
    none_s: float
    two_s: float


def _ids(n: int, vocab: int) -> torch.Tensor:
    # random tokens route about evenly, as the plan assumes (one repeated token would not)
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(n))


def prefill_batch(seqs: int, tokens: int, vocab: int = 2) -> ForwardBatch:
    n = seqs * tokens
    return ForwardBatch(_ids(n, vocab), list(range(seqs)), [0] * seqs, [tokens] * seqs)


def decode_batch(seqs: int, context: int, vocab: int = 2) -> ForwardBatch:
    """One decode step over ``context`` cached tokens each (their values do not change time)."""
    n = seqs
    ids = _ids(n, vocab)
    return ForwardBatch(ids, list(range(n)), [context] * n, [1] * n, is_decode=[True] * n)


def calibration_batches(vocab: int) -> list[ForwardBatch]:
    """Decode first: a decode step reads slower from a cache a long prefill has widened (its
    rows grow to the longest sequence), and a bench of decode alone never widens it."""
    decode = [decode_batch(*s, vocab) for s in DECODE_SHAPES]
    return decode + [prefill_batch(*s, vocab) for s in PREFILL_SHAPES]


def nnls(x: torch.Tensor, y: torch.Tensor, required: tuple[int, ...] = ()) -> torch.Tensor:
    """Least squares with every coefficient >= 0: the best of the fits on each subset of the
    columns whose coefficients all come out non-negative (a handful of columns here). Subsets
    keep the ``required`` columns when some such fit exists (a CPU always pays for GEMMs)."""
    cols = x.shape[1]
    best, best_err = None, float("inf")
    for k in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), k):
            if not set(required) <= set(subset):
                continue
            sol = torch.linalg.lstsq(x[:, subset], y[:, None]).solution[:, 0]
            if (sol < 0).any():
                continue
            err = float((x[:, subset] @ sol - y).square().sum())
            if err < best_err:
                best_err, best = err, torch.zeros(cols, dtype=x.dtype)
                best[list(subset)] = sol
    if best is None:
        return nnls(x, y) if required else torch.zeros(cols, dtype=x.dtype)
    return best


def relative_nnls(
    rows: list[list[float]], targets: list[float], required: tuple[int, ...] = ()
) -> list[float]:
    """Non-negative coefficients minimising the relative errors (columns scaled to 1)."""
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    weight = 1 / y.abs().clamp_min(1e-9)
    scale = x.abs().amax(dim=0).clamp_min(1e-30)
    return (nnls(x / scale * weight[:, None], y * weight, required) / scale).tolist()


def features(spec: ModelSpec, layout: PlanLayout, batch: ForwardBatch) -> list[float]:
    """[GEMM FLOPs, attention FLOPs, KV bytes read, prefill and decode sequence passes]."""
    row = []
    for unit in UNITS:
        cluster = dataclasses.replace(UNIT, nodes=layout.world, **unit)
        planner = Planner(spec, cluster, layout)
        row.append(planner.plan("none", OverlapConfig(), [batch] * layout.world).seconds)
    return row


def fit_link(samples: list[Sample]) -> tuple[float, float]:
    """(latency seconds, bytes per second) from every all-to-all: time = lat + bytes / rate.
    Spans name their bytes in MB to two decimals: those under 0.1 MB are too coarse to use."""
    pairs = [t for s in samples for t in s.transfers if t[0] >= 0.1e6]
    latency, per_byte = relative_nnls([[1.0, b] for b, _ in pairs], [d for _, d in pairs])
    return latency, 1 / per_byte if per_byte > 0 else HUGE


def fit_cluster(
    spec: ModelSpec, layout: PlanLayout, samples: list[Sample], passes: list[PassSample]
) -> Cluster:
    """This machine as a Cluster, fitted in the module's three steps."""
    return _fit_compute(spec, layout, samples, passes)


def _fit_compute(spec, layout, samples: list[Sample], passes: list[PassSample]) -> Cluster:
    latency, rate = fit_link(samples)
    rows = [[*features(spec, layout, s.batch), 1.0] for s in samples]
    ops = len(Planner(spec, UNIT, layout).ops("none"))
    extra = _median([p.two_s - p.none_s for p in passes])
    per_pass = max(extra, 0.0)
    for _ in range(3):  # per_pass: the measured extra less what the plan adds beyond overheads
        computes = [s.wall_s - s.comm_s - per_pass for s in samples]
        per_gemm, per_attn, per_kv, per_seq, per_dec, forward = relative_nnls(
            rows, computes, required=(0, 1)
        )
        cluster = Cluster(
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
            intra_node_a2a_gbps=rate / 1e9,
            inter_node_a2a_gbps=rate / 1e9,
            a2a_latency_us=latency * 1e6,
            op_overhead_us=per_pass / ops * 1e6,
            seq_overhead_us=per_seq * 1e6,
            decode_seq_overhead_us=per_dec * 1e6,
            forward_overhead_us=forward * 1e6,
            activation_bytes=4,
            attention_full_rectangle_with_prefix=True,
            sources={"all": f"fitted: no-overlap prefill {PREFILL_SHAPES} and decode "
            f"{DECODE_SHAPES}, decode {TINY} with and without two micro-batches"},
        )  # fmt: skip
        predicted = _median([_two_minus_none(spec, cluster, layout, p.batch) for p in passes])
        if abs(predicted - extra) < 1e-4 * max(extra, 1e-3):
            break
        per_pass = max(per_pass + extra - predicted, 0.0)
    return cluster


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _two_minus_none(spec, cluster, layout, batch) -> float:
    planner = Planner(spec, cluster, layout)
    batches = [batch] * layout.world
    two = planner.plan("tbo", TWO_PASSES, batches).seconds
    return two - planner.plan("none", OverlapConfig(), batches).seconds
