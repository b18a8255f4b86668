"""What ``--cluster this`` measures: the shapes, the measured forwards, and their JSON form
(``plan --calibration PATH`` keeps them, to plan again without measuring again)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import median

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import DBO, TBO
from moe_overlap.planner.inputs import ModelSpec

# (sequences, tokens[, cached prefix]): the chunk on a prefix times attention's whole rectangle
# (seqs, new tokens, cached prefix)
PREFILL_SHAPES = (
    (1, 256, 0),
    (1, 1024, 0),
    (1, 2048, 0),
    (2, 1024, 0),
    (32, 8, 0),
    (1, 1024, 1024),
)
DECODE_SHAPES = ((2, 16), (4, 512), (16, 256), (64, 128), (64, 384), (32, 512))  # (seqs, context)
TINY = (2, 16)  # decode shapes whose second pass is measured: a tiny one (an op's cost),
MID = (32, 16)  # one where every micro-batch runs every local expert (an expert's cost),
LONG = (16, 256)  # one with a context, whose all-to-alls take link time a second pass may hide
TWO_PASSES = {  # the overlapped runs measured against none: TINY split 1 + 1, MID 16 + 16
    TBO.name: OverlapConfig(TBO.name),
    DBO.name: OverlapConfig(DBO.name, dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1),
}
PAIRS = ((TBO.name, TINY), (TBO.name, MID), (DBO.name, TINY), (TBO.name, LONG), (DBO.name, LONG))
ROW_BYTES_PER_ELEMENT = 4  # the engine's float32 rows, which the dispatch labels count


@dataclass(frozen=True)
class Sample:
    """One measured no-overlap forward: every rank ran ``batch``."""

    batch: ForwardBatch
    wall_s: float
    comm_s: float  # the slowest rank's all-to-all time in it
    transfers: tuple[tuple[float, float], ...] = ()  # (bytes, seconds) of its all-to-alls
    routed: tuple[tuple[tuple[float, float], ...], ...] = ()  # per dispatch (a MoE layer's),
    # per rank: the bytes it sent off the rank and received (which ranks' experts the router
    # favoured there); files saved before per-layer labels hold one entry, the sums


@dataclass(frozen=True)
class PassSample:
    """A decode batch's median walls with no overlap and with two micro-batches (``mode``)."""

    batch: ForwardBatch
    none_s: float
    two_s: float
    mode: str = TBO.name


def measurements_json(samples: list[Sample], passes: list[PassSample], about: dict) -> dict:
    """The raw measurements (not the fit), to plan again without measuring again."""
    return {
        **about,
        "samples": [
            [
                s.wall_s,
                s.comm_s,
                [list(t) for t in s.transfers],
                [[list(r) for r in layer] for layer in s.routed],
            ]
            for s in samples
        ],
        "passes": [
            [p.mode, p.batch.num_seqs, p.batch.prefix_lens[0], p.none_s, p.two_s] for p in passes
        ],
    }


def measurements_from_json(
    raw: dict, vocab: int, about: dict
) -> tuple[list[Sample], list[PassSample]]:
    """``measurements_json``'s output back, checked against this run's config, link and ranks."""
    if not isinstance(raw, dict):
        raise ConfigError("--calibration holds no measurements object: remove it to measure again")
    for key, value in about.items():
        if raw.get(key) != value:
            raise ConfigError(
                f"--calibration was measured with {key}={raw.get(key)!r}, this plan has "
                f"{value!r}: remove the file (or pass another path) to measure again"
            )
    batches = calibration_batches(vocab)
    shapes = raw.get("samples")
    if not isinstance(shapes, list) or len(shapes) != len(batches):
        held = len(shapes) if isinstance(shapes, list) else "no list of"
        raise ConfigError(
            f"--calibration holds {held} shapes, this version measures {len(batches)}: remove "
            "the file to measure again"
        )
    try:
        samples = [_sample(b, row) for b, row in zip(batches, raw["samples"], strict=True)]
        passes = [
            PassSample(decode_batch(int(seqs), int(ctx), vocab), float(none), float(two), mode)
            for mode, seqs, ctx, none, two in raw["passes"]
        ]
        for p in passes:
            if p.mode not in TWO_PASSES:
                raise ValueError(f"pair mode {p.mode!r}, not one of {sorted(TWO_PASSES)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"--calibration: malformed measurements ({exc!r}): remove the file to measure again"
        ) from None
    return samples, passes


def _sample(batch: ForwardBatch, row: list) -> Sample:
    """A saved sample: [wall, comm, transfers] and, from files that have it, routed (per
    layer, or from older files per rank summed over the layers)."""
    wall, comm, transfers, *routed = row
    pairs = tuple((float(n), float(t)) for n, t in transfers)
    layers = routed[0] if routed else []
    if layers and not isinstance(layers[0][0], list):
        layers = [layers]  # sums: one entry
    by_layer = tuple(tuple((float(o), float(i)) for o, i in layer) for layer in layers)
    return Sample(batch, float(wall), float(comm), pairs, by_layer)


def _ids(n: int, vocab: int, rank: int = 0) -> torch.Tensor:
    # random tokens (one repeated token would route every row to the same experts)
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(n + 7919 * rank))


def rank_batches(batch: ForwardBatch, world: int, vocab: int) -> list[ForwardBatch]:
    """``batch``'s shape on every rank, each with tokens of its own, as the bench's ranks
    hold different requests: the tokens decide how unevenly the experts are loaded, and so the
    forward's time (docs/planner.md has the measurement)."""
    return [replace(batch, input_ids=_ids(batch.num_tokens, vocab, r)) for r in range(world)]


def prefill_batch(seqs: int, tokens: int, prefix: int = 0, vocab: int = 2) -> ForwardBatch:
    """``seqs`` sequences of ``tokens`` new tokens each after ``prefix`` cached ones (their
    values do not change time)."""
    n = seqs * tokens
    return ForwardBatch(_ids(n, vocab), list(range(seqs)), [prefix] * seqs, [tokens] * seqs)


def decode_batch(seqs: int, context: int, vocab: int = 2) -> ForwardBatch:
    """One decode step over ``context`` cached tokens each (their values do not change time)."""
    n = seqs
    ids = _ids(n, vocab)
    return ForwardBatch(ids, list(range(n)), [context] * n, [1] * n, is_decode=[True] * n)


def calibration_batches(vocab: int) -> list[ForwardBatch]:
    """Decode first: a decode step reads slower from a cache a long prefill has widened (its
    rows grow to the longest sequence), and a bench of decode alone never widens it."""
    decode = [decode_batch(*s, vocab) for s in DECODE_SHAPES]
    prefill = [prefill_batch(*s, vocab=vocab) for s in PREFILL_SHAPES]
    return decode + prefill


def expert_loads(spec: ModelSpec, sample: Sample) -> list[list[float]]:
    """Per dispatch, per rank: the bytes of rows its experts got, its own rows less those it
    sent off plus those it received (every rank ran the same shape). Files saved before the
    labels named each layer hold one entry, the layers' sums."""
    c = spec.cfg
    moe_layers = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    rows = c.num_experts_per_tok * sample.batch.num_tokens * moe_layers / len(sample.routed or [1])
    own = rows * c.hidden_size * ROW_BYTES_PER_ELEMENT
    return [[own - sent + got for sent, got in layer] for layer in sample.routed]


def expert_shares(spec: ModelSpec, samples: list[Sample], world: int) -> tuple[float, ...]:
    """Per rank, the share of all routed rows its experts got, summed over the samples; ()
    where the samples name no bytes (files saved before they did)."""
    loads = [layer for s in samples if s.routed for layer in expert_loads(spec, s)]
    if world < 2 or not loads:
        return ()
    per_rank = [max(sum(layer[r] for layer in loads), 1e-9) for r in range(world)]
    return tuple(r / sum(per_rank) for r in per_rank)


def imbalance(spec: ModelSpec, sample: Sample) -> float | None:
    """The busiest rank's rows over the mean, averaged over the sample's MoE layers (each
    layer waits for its busiest rank, and which rank that is changes from layer to layer);
    None where the rows are too few for labels in 0.01 MB to tell."""
    loads = expert_loads(spec, sample) if sample.routed else []
    if not loads or min(map(sum, loads)) < 0.5e6 * len(loads[0]):
        return None
    return sum(max(layer) * len(layer) / sum(layer) for layer in loads) / len(loads)


def imbalances(spec: ModelSpec, samples: list[Sample]) -> tuple[list[float], float]:
    """Per sample its imbalance (the typical one where it had too few rows to tell), and the
    typical one (the median; 1 where no sample tells) for a workload not measured."""
    known = [imbalance(spec, s) for s in samples]
    told = [i for i in known if i is not None]
    typical = median(told) if told else 1.0
    return [typical if i is None else i for i in known], typical
