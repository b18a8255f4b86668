"""The token dispatcher: send each token to the ranks owning its top-k experts and back.

Each step is split in two (``_a`` starts, ``_b`` finishes) so that an overlap scheme can run
other work while the communication is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class DispatchState:
    """One micro-batch's routing layout and its in-flight communication, layer by layer."""

    num_tokens: int
    topk_weights: torch.Tensor  # [T, k]
    order: torch.Tensor  # (token, slot) pairs sorted by destination expert
    expert_inputs: torch.Tensor | None = None  # rows grouped by local expert
    tokens_per_expert: list[int] = field(default_factory=list)
    expert_outputs: torch.Tensor | None = None
    pending: Any = None  # the async handle of the all-to-all in flight
    extra: dict[str, Any] = field(default_factory=dict)


class TokenDispatcher:
    """The ``local`` backend: one rank holds every expert, no communication."""

    name = "local"

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchState:
        order, rows, counts = sort_by_expert(hidden, topk_ids, self.num_experts)
        state = DispatchState(hidden.shape[0], topk_weights, order)
        state.expert_inputs, state.tokens_per_expert = rows, counts.tolist()
        return state

    def dispatch_b(self, state: DispatchState) -> None:
        pass  # nothing in flight

    def combine_a(self, state: DispatchState) -> None:
        state.pending = state.expert_outputs

    def combine_a_block(self, state: DispatchState, experts: range) -> None:
        """One piece of a split combine (SBO); on one rank the outputs are already in place."""
        state.pending = state.expert_outputs

    def combine_b(self, state: DispatchState) -> torch.Tensor:
        return weighted_sum(state, state.pending)


def sort_by_expert(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every backend's first step: the (token, slot) pairs sorted by expert (stable, so the
    order is the same on every backend), the hidden row of each, and rows per expert."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, hidden[order // topk_ids.shape[1]], torch.bincount(flat, minlength=num_experts)


def weighted_sum(state: DispatchState, sorted_outputs: torch.Tensor) -> torch.Tensor:
    """Undo the sort and sum each token's expert outputs weighted by its router scores.

    Every backend ends here, in the same order of operations, so their results are identical.
    """
    weights = state.topk_weights
    t, k = weights.shape
    per_slot = torch.empty_like(sorted_outputs)
    per_slot[state.order] = sorted_outputs
    per_slot = per_slot.view(t, k, sorted_outputs.shape[-1])
    return (per_slot * weights.to(per_slot.dtype).unsqueeze(-1)).sum(dim=1)
