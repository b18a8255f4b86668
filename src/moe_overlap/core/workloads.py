"""Benchmark workloads: what each rank prefills or decodes in one forward, and its batches
(``make_batches``: seeded random token ids).

``single-long[:N]``   one request of N tokens per rank (default 3072, the reference's case)
``uniform:A-B[:T]``   lengths drawn uniformly from A..B (seeded) until each rank holds T tokens
                      (default 3072); the reference's mixed case is ``uniform:30-3072``, the
                      commands' default (``DEFAULT_WORKLOAD``)
``decode:BS[:CTX]``   one decode step of BS sequences per rank, each with CTX tokens of context
``file:PATH``         a JSON list of prompt lengths (dealt to the ranks, fewest tokens first), or
                      a list with one list of lengths per rank
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig

DEFAULT_WORKLOAD = "uniform:30-3072"
WORKLOAD_GRAMMAR = "single-long[:N], uniform:A-B[:T], decode:BS[:CTX] or file:PATH"


class WorkloadError(ValueError):
    """A workload spec that cannot be parsed or served."""


@dataclass
class Workload:
    spec: str
    lengths: list[list[int]]  # per rank: the new tokens of each sequence in the timed forward
    context: int = 0  # decode: tokens already in each sequence's cache

    @property
    def decode(self) -> bool:
        return self.context > 0

    @property
    def tokens(self) -> int:
        return sum(map(sum, self.lengths))

    @property
    def longest(self) -> int:
        """The longest sequence's tokens after the forward: context, new tokens, the sampled one."""
        return max(max(lengths) for lengths in self.lengths) + self.context + 1


def check_fits(what: str, tokens: int, cfg: ModelConfig, max_model_len: int | None = None) -> None:
    """Refuse a sequence of ``tokens`` tokens (``what`` says whose) longer than the model
    serves (``ModelConfig.max_len``)."""
    context = cfg.max_len(max_model_len)
    if tokens > context:
        positions = context == cfg.max_position_embeddings
        limit = "max_position_embeddings" if positions else "--max-model-len"
        raise ConfigError(
            f"{what}: a sequence of {tokens} tokens exceeds the model's context of {context} "
            f"tokens ({limit}={context}); use shorter ones"
        )


def parse_workload(spec: str, ranks: int, seed: int = 0) -> Workload:
    kind, _, arg = spec.partition(":")
    if kind == "single-long":
        n = _int(arg or "3072", spec, "N")
        return Workload(spec, [[n] for _ in range(ranks)])
    if kind == "uniform":
        bounds, _, total = arg.partition(":")
        lo_text, _, hi_text = bounds.partition("-")
        lo, hi = _int(lo_text, spec, "A"), _int(hi_text, spec, "B")
        if lo > hi:
            raise WorkloadError(
                f"workload {spec!r}: A={lo} is larger than B={hi}; write uniform:A-B "
                "with A <= B, e.g. uniform:30-3072"
            )
        budget = _int(total or "3072", spec, "T")
        rng = random.Random(seed)
        return Workload(spec, [_draw(rng, lo, hi, budget) for _ in range(ranks)])
    if kind == "decode":
        bs, _, ctx = arg.partition(":")
        size, context = _int(bs, spec, "BS"), _int(ctx or "512", spec, "CTX")
        return Workload(spec, [[1] * size for _ in range(ranks)], context)
    if kind == "file":
        return Workload(spec, _from_file(Path(arg), ranks, spec))
    raise WorkloadError(f"unknown workload {spec!r}; use {WORKLOAD_GRAMMAR}")


def make_batches(workload: Workload, vocab: int, seed: int) -> list[ForwardBatch]:
    """The timed forward of each rank (prefill from scratch, or one decode step)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for lengths in workload.lengths:
        n = len(lengths)
        batches.append(
            ForwardBatch(
                torch.randint(vocab, (sum(lengths),), generator=gen),
                list(range(n)),
                [workload.context] * n,
                list(lengths),
                is_decode=[workload.decode] * n,
            )
        )
    return batches


def _int(text: str, spec: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WorkloadError(f"workload {spec!r}: {name}={text!r} is not an integer") from None
    if value < 1:
        raise WorkloadError(f"workload {spec!r}: {name}={value} must be >= 1")
    return value


def _draw(rng: random.Random, lo: int, hi: int, budget: int) -> list[int]:
    lengths: list[int] = []
    left = budget  # a running count: summing the list at each draw was quadratic
    while left > 0:
        lengths.append(min(rng.randint(lo, hi), left))
        left -= lengths[-1]
    return lengths


def _from_file(path: Path, ranks: int, spec: str) -> list[list[int]]:
    if not path.is_file():
        raise WorkloadError(f"workload {spec!r}: no file at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"workload {spec!r}: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise WorkloadError(
            f"workload {spec!r}: {path} must hold a non-empty JSON list of "
            "prompt lengths, e.g. [120, 3000, 45]"
        )
    if all(isinstance(x, list) for x in data):
        if len(data) != ranks:
            raise WorkloadError(f"workload {spec!r}: {len(data)} per-rank lists for {ranks} ranks")
        per_rank = data
    else:
        _check_lengths(data, spec)  # before dealing: the deal sums them
        if len(data) < ranks:
            raise WorkloadError(
                f"workload {spec!r}: {len(data)} lengths cannot be dealt to {ranks} ranks (each "
                "needs at least one); give one per rank or more, or per-rank lists"
            )
        per_rank = [[] for _ in range(ranks)]
        totals = [0] * ranks  # kept as dealt: summing every list per length was quadratic
        for n in data:  # the minimum-tokens DP controller
            rank = min(range(ranks), key=totals.__getitem__)
            per_rank[rank].append(n)
            totals[rank] += n
    for lengths in per_rank:
        _check_lengths(lengths, spec)
    return per_rank


def _check_lengths(lengths: list, spec: str) -> None:
    if not lengths or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths
    ):
        raise WorkloadError(
            f"workload {spec!r}: every rank needs at least one length, and "
            f"each length must be a positive integer (got {lengths!r})"
        )
