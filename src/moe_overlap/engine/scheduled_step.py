"""One scheduled step: each rank's batch, the requests it feeds and how many tokens, the page
changes the ranks apply first, and a verify step's drafts; ``make_batch`` builds a rank's
batch from its sequences."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import PageOps, SampleSpec, WaveSlice
from moe_overlap.engine.request import Request
from moe_overlap.engine.structured import BitmaskFill


@dataclass
class Step:
    batches: list[ForwardBatch]  # one per rank; an idle rank gets an empty batch
    scheduled: list[list[tuple[Request, int]]]  # per rank: (request, tokens fed)
    prefill: WaveSlice | None = None  # --enable-pdmux: the split prefill beside it
    sampled: list[Request] = field(default_factory=list)  # filled by update: got a token
    pages: list[PageOps] = field(default_factory=list)  # per rank: page changes before it
    # per rank, per sequence: the draft tokens it feeds after its last (a verify step), or none
    drafts: list[list[list[int]]] = field(default_factory=list)

    def samples(self, fill: BitmaskFill | None = None) -> list[list[SampleSpec]]:
        """Per group, per scheduled sequence: what its rank does with its logits. ``fill``:
        the structured outputs' bitmasks, every drawing one's in one call (else each its
        own)."""
        specs = [
            [
                req.sample_spec(n, d, masks=fill is None)
                for (req, n), d in zip(group, self.drafts_of(rank), strict=True)
            ]
            for rank, group in enumerate(self.scheduled)
        ]
        if fill is None:
            return specs
        at = [
            (rank, i, req.constraint)
            for rank, group in enumerate(self.scheduled)
            for i, (req, _) in enumerate(group)
            if req.constraint is not None and specs[rank][i].draw
        ]
        rows = fill([c for _, _, c in at], [specs[r][i].drafts for r, i, _ in at]) if at else []
        for (rank, i, _), allowed in zip(at, rows, strict=True):
            specs[rank][i] = dataclasses.replace(specs[rank][i], allowed=allowed)
        return specs

    def drafts_of(self, rank: int) -> list[list[int]]:
        return self.drafts[rank] if self.drafts else [[] for _ in self.scheduled[rank]]


def make_batch(
    seqs: list[tuple[Request, list[int]]], drafts: list[list[int]] | None = None
) -> ForwardBatch:
    """The batch of ``seqs``; a sequence with ``drafts`` is verified: every row's logits."""
    verify = [bool(d) for d in drafts] if drafts else [False] * len(seqs)
    if not seqs:
        return ForwardBatch.idle()
    return ForwardBatch(
        input_ids=torch.tensor([t for _, tokens in seqs for t in tokens], dtype=torch.long),
        slots=[req.slot for req, _ in seqs],
        prefix_lens=[req.num_computed for req, _ in seqs],
        extend_lens=[len(tokens) for _, tokens in seqs],
        all_logits=[req.needs_all_logits or v for (req, _), v in zip(seqs, verify, strict=True)],
        is_decode=[not req.in_prefill for req, _ in seqs],
    )
