"""Whether every EP rank micro-batches this step under DBO, and where the batch is cut.

vLLM's rule (reference 001, DESIGN.md s5 "Agreement across ranks"): each rank writes
``(tokens, padded tokens, vote, graph mode)`` into its column of a ``4 x ep`` table, zeros
elsewhere, and one all-reduce(SUM) gives every rank the whole table. Then, identically everywhere:

1. micro-batch only if every rank voted yes (a rank votes yes if its token count reaches the
   decode threshold for an all-decode batch, the prefill threshold otherwise);
2. pad to the max: the split point is ``max(padded tokens) // 2`` on every rank;
3. abort if the last micro-batch would be empty on any rank, i.e. if
   ``min(tokens) <= split point``.

An idle rank (0 tokens) votes no (0 is below either threshold, both are >= 1) and would also
trip rule 3, so one idle rank makes the whole step run without micro-batching. Once the rules
pass, every rank has tokens on both sides of the split point, so no rank runs an empty
second micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_overlap.config import OverlapConfig
from moe_overlap.engine.forward_batch import ForwardBatch, ForwardMode

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


def local_column(batch: ForwardBatch, cfg: OverlapConfig) -> list[int]:
    """This rank's column of the table: tokens, padded tokens, vote, graph mode."""
    tokens = batch.num_tokens
    padded = tokens  # no CUDA graphs and attention TP 1 here: nothing to pad a batch to
    vote = dbo_vote(tokens, batch.mode == ForwardMode.DECODE, cfg)
    return [tokens, padded, int(vote), 0]


def decide(table: torch.Tensor) -> DboDecision:
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


def gather_table(batch: ForwardBatch, cfg: OverlapConfig, group) -> torch.Tensor:
    """Every rank's column, by one all-reduce(SUM) over the EP group (no collective alone)."""
    size = group.size if group is not None else 1
    rank = group.rank if group is not None else 0
    table = torch.zeros(4, size, dtype=torch.int64)
    table[:, rank] = torch.tensor(local_column(batch, cfg), dtype=torch.int64)
    if size > 1:
        table = group.all_reduce(table, op=dist.ReduceOp.SUM)
    return table


def agree(batch: ForwardBatch, cfg: OverlapConfig, group) -> DboDecision:
    """One collective per forward, so every rank takes the same path."""
    return decide(gather_table(batch, cfg, group))
