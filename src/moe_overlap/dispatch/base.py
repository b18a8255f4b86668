"""The token dispatcher's contract: send each token to the ranks owning its top-k experts and
bring the expert outputs back.

Each step is split in two (``_a`` starts, ``_b`` finishes) so that an overlap scheme can run
other work while the communication is in flight. Every backend starts with ``sort_by_expert``
and ends with ``weighted_sum``, in the same order of operations, so all give identical results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


class Pending(ABC):
    """Communication in flight. ``wait`` returns its rows; a second ``wait`` returns at once.

    ``waiter`` names the micro-batch that blocks on it (the owner's, by default: under DBO the
    other micro-batch runs the owner's receive as a hook)."""

    @abstractmethod
    def wait(self, waiter: str | None = None) -> torch.Tensor: ...


class Ready(Pending):
    """Nothing in flight: the rows are already here (one rank, no communication)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        return self.rows


@dataclass
class DispatchState:
    """One micro-batch's routing layout in one MoE layer, and its communication in flight."""

    num_tokens: int
    topk_weights: torch.Tensor  # [T, k]
    order: torch.Tensor  # (token, slot) pairs sorted by destination expert
    owner: str = "mb0"  # the micro-batch this belongs to, for the timeline
    expert_inputs: torch.Tensor | None = None  # rows grouped by local expert
    tokens_per_expert: list[int] = field(default_factory=list)
    expert_outputs: torch.Tensor | None = None
    pending: Pending | None = None
    scattered: list[int] | None = None  # rows each attention-TP rank dispatched (scatter.py)


class Dispatcher(ABC):
    """A backend: ``local`` (one rank, every expert), ``torch`` (all-to-all over EP ranks) or
    ``none`` (a tensor-parallel MoE: gather, partial experts, all-reduce)."""

    name: str
    num_experts: int  # routed experts over all ranks

    @abstractmethod
    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = "mb0",
        extend: bool = True,
    ) -> DispatchState:
        """Sort the (token, slot) pairs by expert and start sending them to their owners.
        ``extend``: this micro-batch extends (prefill), which some backends' padding reads."""

    @abstractmethod
    def dispatch_b(self, state: DispatchState) -> None:
        """Wait for this rank's rows; fill ``expert_inputs`` and ``tokens_per_expert``."""

    @abstractmethod
    def combine_a(self, state: DispatchState) -> None:
        """Start sending ``expert_outputs`` back to the ranks the rows came from."""

    @abstractmethod
    def combine_a_block(self, state: DispatchState, experts: range) -> None:
        """Start sending the outputs of local experts ``experts`` only (one SBO piece); every
        rank calls it for the same ranges in the same order."""

    def combine_b(self, state: DispatchState) -> torch.Tensor:
        """Wait for every output row and sum each token's outputs by its router weights."""
        return weighted_sum(state, state.pending.wait())


def sort_by_expert(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every backend's first step: the (token, slot) pairs sorted by expert (stable, so the
    order is the same on every backend), the hidden row of each, and rows per expert."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, hidden[order // topk_ids.shape[1]], torch.bincount(flat, minlength=num_experts)


def weighted_sum(state: DispatchState, sorted_outputs: torch.Tensor) -> torch.Tensor:
    """Undo the sort and sum each token's expert outputs weighted by its router scores."""
    weights = state.topk_weights
    t, k = weights.shape
    per_slot = torch.empty_like(sorted_outputs)
    per_slot[state.order] = sorted_outputs
    per_slot = per_slot.view(t, k, sorted_outputs.shape[-1])
    return (per_slot * weights.to(per_slot.dtype).unsqueeze(-1)).sum(dim=1)
