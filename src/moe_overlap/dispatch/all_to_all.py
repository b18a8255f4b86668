"""The ``torch`` dispatcher backend: all-to-all over torch.distributed between EP ranks.

``dispatch_a`` sorts the (token, slot) pairs by expert, which groups them by owning rank,
gathers every rank's per-expert counts (a tiny synchronous all-gather: SBO's blocks balance
the rows that cross to each owner, and every source must know them) and starts the async
all-to-all of hidden states; ``dispatch_b`` waits and regroups the received rows by local
expert.
``combine_a`` starts sending the expert outputs back in the order they came; ``combine_b`` waits
and sums them per token exactly as the local backend does. SBO instead calls
``combine_a_block`` once per block of local experts, each block's piece sent as soon as its
experts finish.

On CUDA every all-to-all runs on the rank's communication stream (``distributed/streams.py``):
launched after the compute that produced its rows, consumed after an event, the modelled link's
delay held on that stream, never on the host. A recorded forward's all-to-all span lasts what
CUDA events measured on that stream, not the host's launch-to-wait time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moe_overlap.core import tracks
from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.dispatcher import (
    Dispatcher,
    DispatchState,
    Pending,
    balanced_blocks,
    in_flight,
    inverse_permutation,
    outputs,
    sort_by_expert,
    unsort,
)
from moe_overlap.core.timeline import Timeline
from moe_overlap.core.transfer import CountsRead, to_device
from moe_overlap.dispatch.fp8_rows import PlainRows
from moe_overlap.dispatch.in_flight import CombinePieces, InFlight
from moe_overlap.dispatch.pieces import piece_layouts
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.distributed.streams import CommStream


class Deferred(Pending):
    """A dispatch whose rows are not sent yet (CUDA): the first ``wait`` finishes the counts'
    read, sends the rows (``send(state, rows, counts)`` makes ``state.pending`` the transfer)
    and waits for them."""

    def __init__(
        self,
        state: AllToAllState,
        rows: torch.Tensor,
        reading: CountsRead,
        send: Callable[[AllToAllState, torch.Tensor, torch.Tensor, torch.cuda.Event | None], None],
    ):
        self.state, self.reading, self.send = state, reading, send
        self.rows: torch.Tensor | None = rows
        self.sent: Pending | None = None

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        if self.sent is None:
            assert self.rows is not None
            self.send(self.state, self.rows, self.reading.wait(), self.reading.ready)
            self.sent, self.rows = in_flight(self.state), None
        return self.sent.wait(waiter)


def _no_rows() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


@dataclass(kw_only=True)
class AllToAllState(DispatchState):
    """The routing layout both directions of this layer's all-to-alls share."""

    # set when the rows are sent: in dispatch_a, or on CUDA in dispatch_b (``deferred``)
    counts: torch.Tensor = field(default_factory=_no_rows)  # [ep, local]: my rows per expert
    recv_counts: torch.Tensor = field(default_factory=_no_rows)  # [ep, local]: theirs to mine
    all_counts: torch.Tensor = field(default_factory=_no_rows)  # [ep, ep, local]: everyone's
    send: list[int] = field(default_factory=list)  # rows I send to each rank
    recv: list[int] = field(default_factory=list)  # rows I receive from each rank
    owner_blocks: list[list[range]] = field(default_factory=list)  # per rank, its SBO blocks
    perm: torch.Tensor = field(default_factory=_no_rows)  # received rows -> grouped by expert
    # SBO's pieces: the rows each sends, among the experts' outputs, and where each piece's
    # returning rows go; per piece its slice of those, and its rows per rank
    outgoing_rows: torch.Tensor = field(default_factory=_no_rows)
    incoming: torch.Tensor = field(default_factory=_no_rows)
    out_cuts: list[tuple[slice, list[int]]] = field(default_factory=list)
    in_cuts: list[tuple[slice, list[int]]] = field(default_factory=list)


class AllToAllDispatcher(Dispatcher[AllToAllState]):
    name = Backend.TORCH

    def __init__(
        self,
        group: Group,
        num_experts: int,
        link: ModelledLink | None = None,
        timeline: Timeline | None = None,
        wire: PlainRows | None = None,
    ):
        self.group, self.ep, self.link = group, group.size, link
        self.wire = wire or PlainRows()  # --moe-dispatch-dtype: the dispatched rows' form
        self.num_experts, self.local = num_experts, num_experts // group.size
        self.timeline = timeline  # records each all-to-all from launch to completion
        self.comm = CommStream(group.device)  # CUDA: the communication stream; CPU: no-op
        # send the rows when first waited for (dispatch_b: the references' order) rather than
        # at once. Off: on an H200 (emulated ep=8, prefill-8192, T_comp ~ T_comm) deferring
        # took tbo+two-chunk from 1.13x to 0.99x, because the eager host reaches dispatch_b
        # only after launching the other micro-batch's stage, by which time the GPU has long
        # finished the sort and the link sat idle. Kept, exact (tests/dispatch), for a
        # forward whose host runs ahead of the GPU.
        self.defer_send = False
        # each received group (source, expert), numbered in the (expert, source) order
        group_id = torch.arange(self.ep * self.local)
        self.expert_major = group_id % self.local * self.ep + group_id // self.local

    def _start(
        self,
        kind: str,
        rows: torch.Tensor,
        send: list[int],
        recv: list[int],
        owner: str,
        crossing: int | None = None,
        after: torch.cuda.Event | None = None,
    ) -> InFlight:
        """Start one all-to-all of ``rows`` on the communication stream. ``crossing``: the
        rows that leave this rank and arrive from others, where the splits do not say (the
        low-latency layout's fixed splits carry padding the link never sees); ``after``: on
        CUDA the event the transfer waits for (default: all the compute stream queued)."""
        me = self.group.rank
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        sent, received = (sum(n) - n[me] for n in (send, recv))
        if crossing is not None:
            sent = received = crossing
        off_rank = max(sent, received) * row_bytes
        link, done = self.link, None
        timed = self.timeline is not None and self.timeline.enabled and self.comm.on_gpu
        with self.comm.launch(after):
            began = self.comm.done(timing=True) if timed else None
            # rows (dispatch's sorted rows, combine's outputs, an SBO piece) came from the
            # compute stream and are read here: without this the allocator could hand their
            # memory to the next compute-stream allocation while the transfer still reads it
            self.comm.hold(rows)
            handle = self.group.all_to_all(rows, send, recv, async_op=True)
            if self.comm.on_gpu:  # the stream, not the host, waits for the rows and the link
                handle.wait()
                if link is not None:
                    seconds = link.latency_s + off_rank / link.bytes_per_s
                    self.comm.delay(seconds, link.gpu_wait)
                link, done = None, self.comm.done(timing=timed)
        out_mb, in_mb = sent * row_bytes / 1e6, received * row_bytes / 1e6
        label = f"{kind} {off_rank / 1e6:.2f} MB ({owner}; {out_mb:.2f} out, {in_mb:.2f} in)"
        return InFlight(handle, link, off_rank, owner, self.timeline, label, done, began)

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> AllToAllState:
        # each token encoded once (FP8: its bytes and scales), then copied to its k experts
        order, rows, counts = sort_by_expert(self.wire.encode(hidden), topk_ids, self.num_experts)
        state = AllToAllState(hidden.shape[0], topk_weights, order, owner)
        # on CUDA the counts' read waits for their copy alone, not for the compute stream
        reading = CountsRead(counts, order.numel())
        if self.defer_send:
            # the references' order: the read is waited for, with the exchange and the launch,
            # when the rows are first waited for (dispatch_b, or DBO's receive hook), once the
            # other micro-batch's stage is queued
            state.pending = Deferred(state, rows, reading, self._send)
        else:  # start the rows now, to overlap what runs next
            self._send(state, rows, reading.wait(), reading.ready)
        return state

    def _send(
        self,
        state: AllToAllState,
        rows: torch.Tensor,
        counts: torch.Tensor,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Exchange the counts (the dispatch's one read of the device, then a collective on
        the host: gloo beside NCCL) and start the rows, on CUDA once ``ready`` (the sort's
        event) has passed, not behind what the compute stream queued after it."""
        counts = counts.view(self.ep, self.local)
        start = time.perf_counter()
        everyone = self.exchange_counts(counts)
        if self.timeline is not None:  # a blocking exchange: the ranks meet here
            self.timeline.add(
                tracks.wait(state.owner), "counts exchange", start, time.perf_counter()
            )
        state.counts, state.all_counts = counts, everyone
        state.recv_counts = everyone[:, self.group.rank].contiguous()  # [p, e]: rank p to my e
        state.send, state.recv = counts.sum(1).tolist(), state.recv_counts.sum(1).tolist()
        state.pending = self._start(
            "dispatch", rows, state.send, state.recv, state.owner, after=ready
        )

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Every rank's ``counts`` (rows to each rank's local experts): ``[ep, ep, local]``."""
        return self.group.all_gather(counts.reshape(1, -1)).view(-1, self.ep, self.local)

    def dispatch_b(self, state: AllToAllState) -> None:
        received = in_flight(state).wait()
        state.pending = None
        recv_counts = state.recv_counts
        # rows arrive grouped by source rank, then expert; regroup by expert, then source: each
        # row's place on the device (on the host it would cost milliseconds per dispatch), in
        # four kernels: one copy, one repeat, one sort, one gather
        both = to_device(torch.stack((self.expert_major, recv_counts.reshape(-1))), received.device)
        by_expert = both[0].repeat_interleave(both[1], output_size=received.shape[0])
        state.perm = torch.argsort(by_expert, stable=True)
        state.arrive(received[state.perm], self.wire)
        state.tokens_per_expert = recv_counts.sum(0).tolist()

    def combine_a(self, state: AllToAllState) -> None:
        back = unsort(outputs(state), state.perm)  # the order they came in
        state.pending = self._start("combine", back, state.recv, state.send, state.owner)

    def combine_blocks(self, state: AllToAllState, num_blocks: int) -> list[range]:
        """Every rank's blocks, from the gathered counts, so a source knows which of its rows
        each piece carries: each owner's balanced by the rows its experts got from other
        ranks, the rows its pieces carry (its own rows never cross)."""
        everyone = state.all_counts  # [source, owner, e]
        crossing = everyone.sum(0) - everyone.diagonal().T  # [owner, e]: rows from other ranks
        state.owner_blocks = [balanced_blocks(rows, num_blocks) for rows in crossing.tolist()]
        state.blocks = state.owner_blocks[self.group.rank]
        return state.blocks

    def combine_a_block(self, state: AllToAllState, block: int) -> None:
        """No counts are exchanged: both sides derive the piece's splits from dispatch's
        counts, so ``combine_b`` sees exactly the rows the unsplit ``combine_a`` would send.
        Every piece's layout is made with the first: a few kernels per layer, not per piece."""
        expert_outputs = outputs(state)
        pieces = state.pending
        if not isinstance(pieces, CombinePieces):
            state.pending = pieces = CombinePieces(sum(state.send), expert_outputs)
            blocks, device = range(len(state.blocks)), expert_outputs.device
            mine = [[state.blocks[b]] * self.ep for b in blocks]
            outgoing, state.out_cuts = piece_layouts(state.recv_counts, mine, device)
            theirs = [[own[b] for own in state.owner_blocks] for b in blocks]
            state.incoming, state.in_cuts = piece_layouts(state.counts, theirs, device)
            # each received row's row among the outputs
            state.outgoing_rows = inverse_permutation(state.perm)[outgoing]
        (cut, send), (into, recv) = state.out_cuts[block], state.in_cuts[block]
        rows = expert_outputs[state.outgoing_rows[cut]]
        kind = f"combine piece {len(pieces.pieces)}"
        pieces.pieces.append(
            (self._start(kind, rows, send, recv, state.owner), state.incoming[into])
        )
