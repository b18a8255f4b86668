"""Whether every EP rank micro-batches this step: one small all-reduce per forward.

Every EP rank must issue the same all-to-alls in the same order, so the choice is collective.

**TBO (SGLang).** Each rank says whether it can split and which forward mode it runs; one
all-reduce(MIN) over ``[can, not EXTEND, not DECODE, not MIXED]`` tells every rank whether all
can split and which modes are present (an idle rank can split and has no mode). TBO runs only
if every rank can and the busy ranks' modes agree (SGLang's rule); ``--tbo-mode-mismatch
prefill`` (ours) runs the prefill strategy everywhere instead of giving up.

**DBO (vLLM).** Each rank writes ``(tokens, padded tokens, vote, graph mode)`` into its column
of a ``4 x ep`` table, zeros elsewhere, and one all-reduce(SUM) gives every rank the whole
table. Then, identically everywhere:

1. micro-batch only if every rank voted yes (a rank votes yes if its token count reaches the
   decode threshold for an all-decode batch, the prefill threshold otherwise);
2. pad to the max: the split point is ``max(padded tokens) // 2`` on every rank;
3. abort if the last micro-batch would be empty on any rank, i.e. if
   ``min(tokens) <= split point``.

An idle rank (0 tokens) votes no (0 is below either threshold, both are >= 1) and would also
trip rule 3, so one idle rank makes the whole step run without micro-batching. Once the rules
pass, every rank has tokens on both sides of the split point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_overlap.core.batch import ForwardBatch, ForwardMode
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.transfer import host_values
from moe_overlap.distributed.groups import Group

_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED)


@dataclass(frozen=True)
class TboDecision:
    run: bool  # micro-batch on every rank, or on none
    decode: bool  # every busy rank is decoding: use the decode strategy
    reason: str = ""  # why not, for logs and tests


def tbo_local_vote(batch: ForwardBatch, min_tokens: int = 2) -> list[int]:
    """This rank's ``[can split, not EXTEND, not DECODE, not MIXED]``. An idle rank can split
    and runs no mode; a batch below ``min_tokens``, or a decode batch of one sequence, cannot."""
    if batch.mode == ForwardMode.IDLE:
        return [1, 1, 1, 1]
    can = batch.num_tokens >= max(min_tokens, 2)
    if batch.decodes:  # target verify votes as decode: split by sequences, decode strategy
        can = can and batch.num_seqs >= 2
    mode = ForwardMode.DECODE if batch.decodes else batch.mode
    return [int(can)] + [int(mode != m) for m in _MODES]


def tbo_decide(votes: list[int], mode_mismatch: str = "off") -> TboDecision:
    """The decision every rank takes from the MIN-reduced votes (a pure function)."""
    can, present = votes[0], [m for m, absent in zip(_MODES, votes[1:], strict=True) if not absent]
    if not can:
        return TboDecision(False, False, "a rank cannot split its batch")
    if not present:
        return TboDecision(False, False, "every rank is idle")
    if len(present) > 1 and mode_mismatch == "off":
        names = ", ".join(m.value for m in present)
        return TboDecision(False, False, f"busy ranks run different forward modes ({names})")
    return TboDecision(True, present == [ForwardMode.DECODE])


def tbo_decide_from(batches: Sequence[ForwardBatch], cfg: OverlapConfig) -> TboDecision:
    """The decision ``tbo_agree`` reaches, from every rank's batch (no collective)."""
    votes = [tbo_local_vote(b, cfg.tbo_min_tokens) for b in batches]
    return tbo_decide([min(column) for column in zip(*votes, strict=True)], cfg.tbo_mode_mismatch)


def tbo_agree(batch: ForwardBatch, cfg: OverlapConfig, group: Group) -> TboDecision:
    votes = torch.tensor(tbo_local_vote(batch, cfg.tbo_min_tokens), dtype=torch.int64)
    if group.size > 1:
        votes = group.all_reduce(votes, op=dist.ReduceOp.MIN)
    return tbo_decide(host_values(votes), cfg.tbo_mode_mismatch)


TOKENS, PADDED, VOTE, GRAPH_MODE = range(4)  # the rows of the agreement table


@dataclass(frozen=True)
class DboDecision:
    run: bool  # micro-batch on every rank, or on none
    split_point: int = 0  # micro-batch 1 starts at this token (of this forward's tokens)
    reason: str = ""  # why not, for logs and tests


def dbo_vote(num_tokens: int, decode: bool, cfg: OverlapConfig) -> bool:
    """vLLM's ``check_ubatch_thresholds``: is this rank's batch big enough to micro-batch?"""
    if decode:
        return num_tokens >= cfg.dbo_decode_token_threshold
    return num_tokens >= cfg.dbo_prefill_token_threshold


def dbo_local_column(batch: ForwardBatch, cfg: OverlapConfig) -> list[int]:
    """This rank's column of the table: tokens, padded tokens, vote, graph mode."""
    tokens = batch.num_tokens
    padded = tokens  # no CUDA graphs and attention TP 1 here: nothing to pad a batch to
    vote = dbo_vote(tokens, batch.decodes, cfg)
    return [tokens, padded, int(vote), 0]


def dbo_decide(table: torch.Tensor) -> DboDecision:
    """The decision every rank takes from the all-reduced ``4 x ep`` table (a pure function)."""
    if table.dim() != 2 or table.shape[0] != 4 or table.shape[1] < 1:
        raise ValueError(f"agreement table must be 4 x ep, got {tuple(table.shape)}")
    no = (table[VOTE] != 1).nonzero().flatten().tolist()
    if no:
        return DboDecision(False, reason=f"ranks {no} voted no")
    split = int(table[PADDED].max()) // 2  # pad to the max, then halve
    smallest = int(table[TOKENS].argmin())
    tokens = int(table[TOKENS, smallest])
    if tokens <= split:
        return DboDecision(
            False,
            reason=f"rank {smallest}'s last micro-batch would be empty "
            f"({tokens} tokens, split at token {split})",
        )
    return DboDecision(True, split)


def dbo_decide_from(batches: Sequence[ForwardBatch], cfg: OverlapConfig) -> DboDecision:
    """The decision ``dbo_agree`` reaches, from every rank's batch (no collective)."""
    columns = [dbo_local_column(b, cfg) for b in batches]
    return dbo_decide(torch.tensor(columns, dtype=torch.int64).T)


def dbo_gather_table(batch: ForwardBatch, cfg: OverlapConfig, group: Group) -> torch.Tensor:
    """Every rank's column, by one all-reduce(SUM) over the EP group (no collective alone)."""
    return group.gather_columns(torch.tensor(dbo_local_column(batch, cfg), dtype=torch.int64))


def dbo_agree(batch: ForwardBatch, cfg: OverlapConfig, group: Group) -> DboDecision:
    """One collective per forward, so every rank takes the same path."""
    return dbo_decide(dbo_gather_table(batch, cfg, group))
