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

import functools
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
    weigh,
)
from moe_overlap.core.errors import ConfigError
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.in_flight import CombinePieces


@dataclass(kw_only=True)
class LowLatencyState(DispatchState):
    """One micro-batch's fixed-capacity layout in one MoE layer."""

    slots: torch.Tensor  # each (token, slot) pair's row in the blocks, in pair order


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
        tokens, top_k = topk_ids.shape
        self.check_fits(tokens)
        hidden = self.wire.encode(hidden)  # FP8: each row's bytes and scales
        if self.local * 4 > hidden.shape[1] * hidden.element_size():
            raise ConfigError(
                f"--a2a-mode low_latency: {self.local} local experts' counts do not fit in one "
                f"row of {hidden.shape[1]} {hidden.dtype} values; use --a2a-mode normal"
            )
        # no sort: each (token, slot) pair's place among its expert's rows is how many pairs
        # up to it chose that expert, so the pairs go out in their own order, in few launches
        flat = topk_ids.reshape(-1)
        experts, first_rows = send_places(
            self.num_experts, self.local, self.block_rows, flat.device
        )
        seen = (flat[:, None] == experts).cumsum(0, dtype=torch.int32)  # [pairs, experts]
        counts = seen[-1] if tokens else seen.new_zeros(self.num_experts)
        slots = first_rows[flat] + seen.gather(1, flat[:, None]).view(-1)
        # the padding is never read (the experts skip it, the combine gathers the real rows)
        send = hidden.new_empty(self.ep * self.block_rows, hidden.shape[1])
        send[slots.view(tokens, top_k)] = hidden[:, None].expand(-1, top_k, -1)
        header = send.view(self.ep, self.block_rows, -1)[:, 0]
        header.view(torch.int32)[:, : self.local] = counts.view(self.ep, self.local)
        state = LowLatencyState(
            tokens, topk_weights, owner=owner, capacity=self.capacity, slots=slots
        )
        splits = [self.block_rows] * self.ep
        state.pending = self.a2a._start(
            "dispatch", send, splits, splits, owner, self._crossing(slots.numel())
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
        state.counts = received[:, 0].view(torch.int32)[:, : self.local]
        state.arrive(received, self.wire)  # whole blocks: a header, then the experts' rows

    def combine_a(self, state: LowLatencyState) -> None:
        """The outputs go back in the blocks' layout (``run_capacity`` writes each row where
        its input arrived), so each source finds its rows where it put them."""
        rows = outputs(state).view(self.ep * self.block_rows, -1)
        splits = [self.block_rows] * self.ep
        state.pending = self.a2a._start(
            "combine", rows, splits, splits, state.owner, self._crossing(state.slots.numel())
        )

    def combine_blocks(self, state: LowLatencyState, num_blocks: int) -> list[range]:
        """SBO's blocks by expert count: the host does not know the rows (every rank cuts
        alike, so a source knows each owner's blocks without asking)."""
        state.blocks = balanced_blocks([0] * self.local, num_blocks)
        return state.blocks

    def combine_a_block(self, state: LowLatencyState, block: int) -> None:
        expert_outputs = outputs(state)  # [ep, block_rows, hidden]
        pieces = state.pending
        if not isinstance(pieces, CombinePieces):
            rows = self.ep * self.block_rows
            state.pending = pieces = CombinePieces(rows, expert_outputs.view(rows, -1))
        experts = state.blocks[block]
        places = slice(1 + experts.start * self.capacity, 1 + experts.stop * self.capacity)
        piece = expert_outputs[:, places].reshape(-1, expert_outputs.shape[-1])
        splits = [len(experts) * self.capacity] * self.ep
        share = len(experts) / self.local  # of the pairs' rows, by even routing
        crossing = int(self._crossing(state.slots.numel()) * share)
        handle = self.a2a._start(
            f"combine piece {len(pieces.pieces)}", piece, splits, splits, state.owner, crossing
        )
        # where the piece's rows go among the whole combine's: each rank's block of experts
        where = torch.arange(pieces.out.shape[0], device=piece.device)
        pieces.pieces.append((handle, where.view(self.ep, self.block_rows)[:, places].reshape(-1)))

    def combine_b(self, state: LowLatencyState) -> torch.Tensor:
        returned = in_flight(state).wait()
        return weigh(returned[state.slots], state.topk_weights)  # the pairs in their order


@functools.cache
def send_places(
    num_experts: int, local: int, block_rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's id, and the place before its first in a sender's blocks (``[ep,
    block_rows]``: expert g's rows follow rank ``g // local``'s header and the lower
    experts'), as ``dispatch_a`` places the pairs; made once per device, like
    ``group_places``."""
    cap = (block_rows - 1) // local
    expert = torch.arange(num_experts)
    before_first = expert // local * block_rows + expert % local * cap
    return expert.to(device), before_first.to(device)


@functools.cache
def group_places(
    ep: int, block_rows: int, local: int, experts: range, device: torch.device
) -> torch.Tensor:
    """The first place in a rank's received blocks (``[ep, block_rows]``) of each (local
    expert, source rank) group of ``experts``, expert-major, as the experts gather them
    (``ExpertBank.run_capacity``); made once per device (a warm-up forward runs before a CUDA
    graph's capture, so no capture makes it)."""
    cap = (block_rows - 1) // local
    group = torch.arange(len(experts) * ep)
    source, expert = group % ep, group // ep + experts.start
    return (source * block_rows + 1 + expert * cap).to(device)
