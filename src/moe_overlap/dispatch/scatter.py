"""All-to-all under attention TP: the ranks of an attention-TP group hold the same tokens, so
each dispatches only its share of them (SGLang's scattered mode) and the group all-gathers the
combined rows back. Shares differ by at most one row; the gather pads them to the longest and
drops the padding, so no padded row reaches an expert or the logits.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_overlap.core import tracks
from moe_overlap.core.dispatcher import Dispatcher, DispatchState
from moe_overlap.distributed.groups import Group


def shares(rows: int, ranks: int) -> list[int]:
    """``rows`` cut into ``ranks`` contiguous shares, the first ``rows % ranks`` one longer."""
    return [rows // ranks + (r < rows % ranks) for r in range(ranks)]


class ScatteredDispatcher(Dispatcher[DispatchState]):
    def __init__(self, inner: Dispatcher[Any], attn_tp: Group):
        self.inner, self.attn_tp = inner, attn_tp
        self.name, self.num_experts, self.link = inner.name, inner.num_experts, inner.link

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> DispatchState:
        sizes = shares(hidden.shape[0], self.attn_tp.size)
        start = sum(sizes[: self.attn_tp.rank])
        mine = slice(start, start + sizes[self.attn_tp.rank])
        state = self.inner.dispatch_a(
            hidden[mine], topk_ids[mine], topk_weights[mine], owner, extend
        )
        state.scattered = sizes
        return state

    def dispatch_b(self, state: DispatchState) -> None:
        self.inner.dispatch_b(state)

    def combine_a(self, state: DispatchState) -> None:
        self.inner.combine_a(state)

    def combine_blocks(self, state: DispatchState, num_blocks: int) -> list[range]:
        return self.inner.combine_blocks(state, num_blocks)

    def combine_a_block(self, state: DispatchState, block: int) -> None:
        self.inner.combine_a_block(state, block)

    def combine_b(self, state: DispatchState) -> torch.Tensor:
        mine = self.inner.combine_b(state)
        sizes = state.scattered
        if sizes is None:
            raise RuntimeError(f"{state.owner}: combine_b before this dispatcher's dispatch_a")
        longest = max(sizes)
        if longest == 0:  # the group has no tokens: every rank skips the gather
            return mine
        padded = mine.new_zeros(longest, *mine.shape[1:])
        padded[: mine.shape[0]] = mine
        every = self.attn_tp.all_gather(padded)
        return torch.cat([every[r * longest : r * longest + n] for r, n in enumerate(sizes)])
