"""vLLM's logit adjustments on the rank that samples: ``min_tokens``, ``logit_bias`` and the
presence, frequency and repetition penalties, on one sequence's last logits row."""

from __future__ import annotations

import torch

from moe_overlap.core.errors import NothingAllowedError
from moe_overlap.core.step import Penalties


def penalised(logits: torch.Tensor, pen: Penalties, generated: int) -> torch.Tensor:
    """``logits`` (one row) adjusted by ``pen`` after ``generated`` tokens, in fp32."""
    row = logits.float().clone()
    if generated < pen.min_tokens and pen.stop_ids:
        row[list(pen.stop_ids)] = float("-inf")
    for token, bias in pen.logit_bias:
        row[token] += bias
    if pen.repetition != 1.0:
        seen = torch.tensor(sorted({*pen.prompt_ids, *pen.output_ids}), dtype=torch.long)
        seen = seen.to(row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / pen.repetition, values * pen.repetition)
    if pen.output_ids and (pen.frequency or pen.presence):
        ids = torch.tensor(pen.output_ids, dtype=torch.long, device=row.device)
        counts = torch.zeros_like(row).scatter_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
        row -= pen.frequency * counts + pen.presence * (counts > 0).to(row.dtype)
    return row


def some_allowed(row: torch.Tensor, constrained: bool) -> torch.Tensor:
    """``row`` (penalised) as it is; ``NothingAllowedError`` where a ``constrained`` row (a
    grammar's bitmask applied) is left without a token, which min_tokens can do by holding back
    the only token the grammar allows. Unconstrained rows are not read back."""
    if constrained and bool(torch.isneginf(row).all()):
        raise NothingAllowedError
    return row
