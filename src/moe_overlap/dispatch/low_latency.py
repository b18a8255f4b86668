"""The low-latency dispatch (``--a2a-mode low_latency``): fixed-capacity all-to-alls that the host
never sizes, so the forward reads nothing back from the device and a CUDA graph can hold it.

The layout is DeepEP's low-latency one; the data path is ours, two torch all-to-alls with equal
splits per MoE layer (one each way), not the DeepEP library. Each rank sends every peer a
block of ``1 + local * capacity`` rows: a header row whose bits hold its row counts for that
peer's local experts (int32, bit-cast into the rows' dtype, so the counts travel with the rows
in the same collective), then ``capacity`` rows per local expert, the first ``count`` of them
real. ``capacity`` is ``--num-max-dispatch-tokens-per-rank``: a token goes to an expert at most
once, so a micro-batch of at most that many tokens never overflows a block, and a larger one
is refused before it is sent, never cut.

The experts read the padded rows with the counts on the device (``ExpertBank.run_capacity``),
write their outputs in the same places, and the combine sends the blocks back unchanged; each
source then gathers its own rows from the places it put them. Nothing here depends on a host
count, so every step can be captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.core import tracks
from moe_overlap.core.a2a_mode import Backend, over_capacity
from moe_overlap.core.dispatcher import (
    Dispatcher,
    DispatchState,
    balanced_blocks,
    in_flight,
    outputs,
    sort_by_expert,
    weighted_sum,
)
from moe_overlap.core.errors import ConfigError
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.in_flight import CombinePieces


@dataclass(kw_only=True)
class LowLatencyState(DispatchState):
    """One micro-batch's fixed-capacity layout in one MoE layer."""

    slots: torch.Tensor  # each sorted (token, slot) pair's row in the returned combine buffer


class LowLatencyDispatcher(Dispatcher[LowLatencyState]):
    """All-to-alls of fixed size over ``a2a``'s group, communication stream and link."""

    name = Backend.TORCH

    def __init__(self, a2a: AllToAllDispatcher, capacity: int):
        if capacity < 1:
            raise ConfigError(f"--num-max-dispatch-tokens-per-rank={capacity} must be >= 1")
        self.a2a, self.capacity = a2a, capacity
        self.num_experts, self.ep, self.local = a2a.num_experts, a2a.ep, a2a.local
        self.link, self.wire = a2a.link, a2a.wire
        self.block_rows = 1 + self.local * capacity  # a peer's block: header, then the rows

    def check_fits(self, tokens: int) -> None:
        """Refuse a micro-batch that could overflow a block (before anything is sent)."""
        if tokens > self.capacity:
            raise over_capacity(tokens, self.capacity)

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> LowLatencyState:
        tokens = topk_ids.shape[0]
        self.check_fits(tokens)
        hidden = self.wire.encode(hidden)  # FP8: each row's bytes and scales
        if self.local * 4 > hidden.shape[1] * hidden.element_size():
            raise ConfigError(
                f"--a2a-mode low_latency: {self.local} local experts' counts do not fit in one "
                f"row of {hidden.shape[1]} {hidden.dtype} values; use --a2a-mode normal"
            )
        order, rows, counts = sort_by_expert(hidden, topk_ids, self.num_experts)
        # each sorted pair's place among its expert's rows, then in the send buffer: expert g
        # of rank g // local sits after that rank's header row, ``capacity`` rows per expert
        expert = topk_ids.reshape(-1)[order]
        index = (
            torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[expert]
        )
        slots = expert * self.capacity + index
        send = hidden.new_zeros(self.ep * self.block_rows, hidden.shape[1])
        send.index_copy_(0, slots + expert // self.local + 1, rows)
        header = send.view(self.ep, self.block_rows, -1)[:, 0]
        header.view(torch.int32)[:, : self.local] = counts.view(self.ep, self.local)
        state = LowLatencyState(
            tokens, topk_weights, order, owner, capacity=self.capacity, slots=slots
        )
        splits = [self.block_rows] * self.ep
        state.pending = self.a2a._start(
            "dispatch", send, splits, splits, owner, self._crossing(order.numel())
        )
        return state

    def _crossing(self, pairs: int) -> int:
        """Rows a modelled link charges: the real rows, as DeepEP's transport, which writes
        only them into the fixed blocks, would move (the host knows the pairs, not their
        owners, so routing is taken as uniform: peers get ``(ep - 1) / ep`` of them). Our torch
        all-to-all sends the whole blocks, padding included: over a real link that is up to
        ``num_experts / top_k`` times the bytes, which the modelled figures do not show."""
        return pairs * (self.ep - 1) // self.ep

    def dispatch_b(self, state: LowLatencyState) -> None:
        received = in_flight(state).wait().view(self.ep, self.block_rows, -1)
        state.pending = None
        width = received.shape[-1]
        state.counts = received[:, 0].view(torch.int32)[:, : self.local].long()
        blocks = received[:, 1:].view(self.ep, self.local, self.capacity, width)
        state.arrive(blocks, self.wire)

    def combine_a(self, state: LowLatencyState) -> None:
        rows = outputs(state).reshape(self.ep * self.local * self.capacity, -1)
        splits = [self.local * self.capacity] * self.ep
        pairs = state.order.numel()
        state.pending = self.a2a._start(
            "combine", rows, splits, splits, state.owner, self._crossing(pairs)
        )

    def combine_blocks(self, state: LowLatencyState, num_blocks: int) -> list[range]:
        """SBO's blocks by expert count: the host does not know the rows (every rank cuts
        alike, so a source knows each owner's blocks without asking)."""
        state.blocks = balanced_blocks([0] * self.local, num_blocks)
        return state.blocks

    def combine_a_block(self, state: LowLatencyState, block: int) -> None:
        expert_outputs = outputs(state)  # [ep, local, capacity, hidden]
        pieces = state.pending
        if not isinstance(pieces, CombinePieces):
            rows = self.ep * self.local * self.capacity
            state.pending = pieces = CombinePieces(rows, expert_outputs.view(rows, -1))
        experts = state.blocks[block]
        piece = expert_outputs[:, experts.start : experts.stop].reshape(
            -1, expert_outputs.shape[-1]
        )
        splits = [len(experts) * self.capacity] * self.ep
        share = len(experts) / self.local  # of the pairs' rows, by even routing
        crossing = int(self._crossing(state.order.numel()) * share)
        handle = self.a2a._start(
            f"combine piece {len(pieces.pieces)}", piece, splits, splits, state.owner, crossing
        )
        # where the piece's rows go among the whole combine's: each rank's block of experts
        where = torch.arange(pieces.out.shape[0], device=piece.device)
        where = where.view(self.ep, self.local, self.capacity)[:, experts.start : experts.stop]
        pieces.pieces.append((handle, where.reshape(-1)))

    def combine_b(self, state: LowLatencyState) -> torch.Tensor:
        returned = in_flight(state).wait()
        return weighted_sum(state, returned[state.slots])
