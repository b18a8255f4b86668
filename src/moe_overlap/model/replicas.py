"""EPLB's map from a routed (logical) expert to the physical slot that serves a token: with
redundant experts, an expert has a replica on several ranks, each holding the same weights, so
whichever serves a token the output is the same."""

from __future__ import annotations

import torch
from torch import nn


class ReplicaMap(nn.Module):
    """One MoE layer's map for the rank ``ep_rank`` of ``ep_size``. ``static``: each expert's
    replica nearest this rank (its own, else the fewest ranks away, the lower rank on a tie),
    so a rank always sends an expert's tokens to one place; ``dynamic``: token ``t``'s ``k``-th
    choice goes to replica ``(t + k) % replicas``, spreading a hot expert's tokens over all of
    them, the same way on every run."""

    nearest: torch.Tensor  # [experts]: the static replica
    table: torch.Tensor  # [experts, most replicas]: each expert's slots (padded with its first)
    count: torch.Tensor  # [experts]: replicas each

    def __init__(
        self, physical_to_logical: tuple[int, ...], ep_rank: int, ep_size: int, dynamic: bool
    ):
        super().__init__()
        self.dynamic, self.ep_rank, self.ep_size = dynamic, ep_rank, ep_size
        nearest, table, count = self._tables(physical_to_logical)
        # not in the state dict: the checkpoint has no such tensors
        self.register_buffer("nearest", nearest, persistent=False)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("count", count, persistent=False)

    def _tables(self, physical_to_logical: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``nearest``, ``table`` and ``count`` for a placement; the table is ``ep_size`` wide
        whatever the placement (no rank holds two replicas of an expert), so a new placement
        fits the same buffers."""
        ep_rank, ep_size = self.ep_rank, self.ep_size
        per = len(physical_to_logical) // ep_size
        experts = max(physical_to_logical) + 1
        slots = [[s for s, e in enumerate(physical_to_logical) if e == x] for x in range(experts)]

        def distance(slot: int) -> tuple[int, int]:
            ahead = (slot // per - ep_rank) % ep_size
            return min(ahead, ep_size - ahead), slot // per

        nearest = [min(replicas, key=distance) for replicas in slots]
        table = [r + [r[0]] * (ep_size - len(r)) for r in slots]
        counts = [len(r) for r in slots]
        return torch.tensor(nearest), torch.tensor(table), torch.tensor(counts)

    def update(self, physical_to_logical: tuple[int, ...]) -> None:
        """Serve from a new placement (online EPLB), in place: the same buffers, new values."""
        for buffer, values in zip(
            (self.nearest, self.table, self.count), self._tables(physical_to_logical), strict=True
        ):
            buffer.copy_(values)

    def forward(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``[tokens, k]`` logical expert ids to physical slot ids."""
        ids = topk_ids.long()
        if not self.dynamic:
            return self.nearest[ids]
        tokens, k = ids.shape
        turn = torch.arange(tokens, device=ids.device)[:, None] + torch.arange(k, device=ids.device)
        return self.table[ids, turn % self.count[ids]]
