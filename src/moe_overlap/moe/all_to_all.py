"""The ``torch`` dispatcher backend: all-to-all over torch.distributed between EP ranks.

``dispatch_a`` sorts the (token, slot) pairs by expert, which groups them by owning rank,
exchanges the per-expert counts (a tiny synchronous all-to-all) and starts the async all-to-all
of hidden states; ``dispatch_b`` waits and regroups the received rows by local expert.
``combine_a`` starts sending the expert outputs back in the order they came; ``combine_b`` waits
and sums them per token exactly as the local backend does. SBO instead calls
``combine_a_block`` once per block of local experts, each block's piece sent as soon as its
experts finish.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

from moe_overlap.moe.dispatch import DispatchState, sort_by_expert, weighted_sum


class _Linked:
    """An all-to-all handle that, over a modelled link, completes no sooner than the link would."""

    def __init__(self, handle, link, num_bytes: int):
        self.handle, self.link = handle, link
        self.start = time.perf_counter()
        self.earliest_end = link.reserve(self.start, num_bytes) if link is not None else self.start

    def wait(self, timeline=None) -> torch.Tensor:
        with timeline.span(f"{timeline.current} wait", "wait") if timeline else nullcontext():
            out = self.handle.wait()
            if self.link is not None:
                self.link.sleep_until(self.earliest_end)
        return out


class AllToAllDispatcher:
    name = "torch"

    def __init__(self, group, num_experts: int, link=None, timeline=None):
        if num_experts % group.size:
            raise ValueError(f"--ep={group.size} does not divide num_experts={num_experts}")
        self.group, self.ep, self.link = group, group.size, link
        self.local = num_experts // group.size
        self.timeline = timeline  # records each all-to-all from launch to completion

    def _start(self, kind: str, rows: torch.Tensor, send: list[int], recv: list[int]) -> _Linked:
        me = self.group.rank
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        off_rank = max(sum(send) - send[me], sum(recv) - recv[me]) * row_bytes
        handle = self.group.all_to_all(rows, send, recv, async_op=True)
        linked = _Linked(handle, self.link, off_rank)
        timeline = self.timeline
        if timeline is not None and timeline.enabled:

            def done() -> None:
                end = max(time.perf_counter(), linked.earliest_end)
                timeline.add("comm", f"{kind} {off_rank / 1e6:.2f} MB", linked.start, end)

            handle.on_complete(done)
        return linked

    def _recording(self):
        """The timeline, when it records the time micro-batches spend blocked on a receive."""
        return self.timeline if self.timeline is not None and self.timeline.enabled else None

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchState:
        order, rows, counts = sort_by_expert(hidden, topk_ids, self.ep * self.local)
        counts = counts.view(self.ep, self.local)  # rows for each rank's local experts
        # recv_counts[p, e]: rows rank p sends to my local expert e
        recv_counts = self.group.all_to_all(counts.contiguous(), [1] * self.ep, [1] * self.ep)
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        state = DispatchState(hidden.shape[0], topk_weights, order)
        state.extra.update(send=send, recv=recv, recv_counts=recv_counts, counts=counts)
        state.pending = self._start("dispatch", rows, send, recv)
        return state

    def dispatch_b(self, state: DispatchState) -> None:
        received = state.pending.wait(self._recording())
        state.pending = None
        recv_counts = state.extra["recv_counts"]
        # rows arrive grouped by source rank, then expert; regroup by expert, then source
        source = torch.repeat_interleave(torch.arange(recv_counts.numel()), recv_counts.reshape(-1))
        by_expert = source % self.local * self.ep + source // self.local
        perm = torch.argsort(by_expert, stable=True)
        state.extra["perm"] = perm
        state.expert_inputs = received[perm]
        state.tokens_per_expert = recv_counts.sum(0).tolist()

    def combine_a(self, state: DispatchState) -> None:
        outputs = torch.empty_like(state.expert_outputs)
        outputs[state.extra["perm"]] = state.expert_outputs  # back to the order they came in
        state.pending = self._start("combine", outputs, state.extra["recv"], state.extra["send"])

    def combine_a_block(self, state: DispatchState, experts: range) -> None:
        """Start returning the outputs of local experts ``experts`` only (one SBO piece).

        Every rank must call this for the same ranges in the same order; ``combine_b`` then
        waits for all pieces and sees exactly the rows the unsplit ``combine_a`` would send.
        No counts are exchanged: both sides derive the piece's splits from dispatch's counts.
        """
        if state.pending is None:
            state.pending = CombinePieces(sum(state.extra["send"]), state.expert_outputs)
            perm = state.extra["perm"]
            # where each received row (source-major order) sits in expert_outputs
            state.extra["row_of"] = torch.empty_like(perm)
            state.extra["row_of"][perm] = torch.arange(perm.numel(), device=perm.device)
        outgoing, send = piece_layout(state.extra["recv_counts"], experts)
        incoming, recv = piece_layout(state.extra["counts"], experts)
        rows = state.expert_outputs[state.extra["row_of"][outgoing]]
        kind = f"combine piece {len(state.pending.pieces)}"
        state.pending.pieces.append((self._start(kind, rows, send, recv), incoming))

    def combine_b(self, state: DispatchState) -> torch.Tensor:
        return weighted_sum(state, state.pending.wait(self._recording()))


def piece_layout(counts: torch.Tensor, experts: range) -> tuple[torch.Tensor, list[int]]:
    """The rows of local experts ``experts`` in a buffer grouped by (rank, local expert).

    ``counts[p, e]`` is the size of group (p, e). Returns their positions in buffer order and
    the rows per rank. A source rank applies it to the counts it sent, an expert owner to the
    counts it received, so both agree on every piece's splits and row order.
    """
    ranks, local = counts.shape
    experts_of = torch.arange(local, device=counts.device).repeat(ranks)
    expert_of_row = experts_of.repeat_interleave(counts.reshape(-1))
    inside = (expert_of_row >= experts.start) & (expert_of_row < experts.stop)
    per_rank = counts[:, experts.start : experts.stop].sum(1)
    return inside.nonzero().reshape(-1), per_rank.tolist()


class CombinePieces:
    """A combine sent as several all-to-alls; ``wait`` reassembles the unsplit combine's rows."""

    def __init__(self, rows: int, like: torch.Tensor):
        self.out = like.new_empty((rows, *like.shape[1:]))
        self.pieces: list[tuple[_Linked, torch.Tensor]] = []  # (handle, positions in out)

    def wait(self, timeline=None) -> torch.Tensor:
        for handle, positions in self.pieces:
            self.out[positions] = handle.wait(timeline)
        self.pieces = []
        return self.out
