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
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from moe_overlap.core.dispatcher import (
    Dispatcher,
    DispatchState,
    Pending,
    balanced_blocks,
    in_flight,
    outputs,
    sort_by_expert,
)
from moe_overlap.core.timeline import Timeline
from moe_overlap.core.transfer import read_counts, to_device
from moe_overlap.dispatch.pieces import piece_layouts
from moe_overlap.distributed.comm import CommHandle
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.distributed.streams import CommStream, consume


class InFlight(Pending):
    """One all-to-all; over a modelled link it completes no sooner than the link would.

    While the timeline records, the all-to-all's span runs from its launch to its completion:
    the completion callback's time, or the first wait's return if that comes first (a callback
    thread may get the GIL late, and the rows are surely here once a wait returns)."""

    def __init__(
        self,
        handle: CommHandle,
        link: ModelledLink | None,
        num_bytes: int,
        owner: str,
        timeline: Timeline | None,
        label: str = "all-to-all",
        done: torch.cuda.Event | None = None,
        began: torch.cuda.Event | None = None,
    ):
        self.handle, self.link, self.owner = handle, link, owner
        self.label, self.done = label, done  # done: the communication stream's event (CUDA)
        self.began = began  # CUDA, while recording: a timing event before the transfer
        self.start = time.perf_counter()
        self.earliest_end = link.reserve(self.start, num_bytes) if link is not None else self.start
        self.completed_at: float | None = None
        # the timeline while this all-to-all's span is still to be added
        self.recording = timeline if timeline is not None and timeline.enabled else None
        if self.recording is not None:
            handle.on_complete(self._completed)

    def _completed(self) -> None:
        self.completed_at = max(time.perf_counter(), self.earliest_end)

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        who = waiter or self.owner
        label = "wait" if who == self.owner else f"receive hook for {self.owner}"
        recording = self.recording
        with recording.span(f"{who} wait", label) if recording is not None else nullcontext():
            out = consume(self.done, self.handle.wait())  # every waiter's stream waits
            if self.link is not None:
                self.link.sleep_until(self.earliest_end)
        if recording is not None and self.began is not None:
            self.recording = None  # on the GPU: its length from the stream's events
            recording.add_later("comm", self.label, self._gpu_span)
        elif recording is not None:
            self.recording = None  # one span per all-to-all, at its first wait
            now = time.perf_counter()
            end = now if self.completed_at is None else min(self.completed_at, now)
            recording.add("comm", self.label, self.start, end)
        return out

    def _gpu_span(self) -> tuple[float, float]:
        """From the launch, as long as the communication stream took (events, not host)."""
        assert self.began is not None and self.done is not None
        self.done.synchronize()
        return self.start, self.start + self.began.elapsed_time(self.done) / 1e3


class CombinePieces(Pending):
    """A combine sent as several all-to-alls; ``wait`` reassembles the unsplit combine's rows."""

    def __init__(self, rows: int, like: torch.Tensor):
        self.out = like.new_empty((rows, *like.shape[1:]))
        self.pieces: list[tuple[InFlight, torch.Tensor]] = []  # (handle, positions in out)

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        for handle, positions in self.pieces:
            self.out[positions] = handle.wait(waiter)
        self.pieces = []
        return self.out


def _no_rows() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


@dataclass(kw_only=True)
class AllToAllState(DispatchState):
    """The routing layout both directions of this layer's all-to-alls share."""

    counts: torch.Tensor  # [ep, local]: rows I send to each rank's local experts
    recv_counts: torch.Tensor  # [ep, local]: rows each rank sends my experts
    all_counts: torch.Tensor  # [ep, ep, local]: every rank's ``counts``
    send: list[int]  # rows I send to each rank
    recv: list[int]  # rows I receive from each rank
    owner_blocks: list[list[range]] = field(default_factory=list)  # per rank, its SBO blocks
    perm: torch.Tensor = field(default_factory=_no_rows)  # received rows -> grouped by expert
    # SBO's pieces: the rows each sends, among the experts' outputs, and where each piece's
    # returning rows go; per piece its slice of those, and its rows per rank
    outgoing_rows: torch.Tensor = field(default_factory=_no_rows)
    incoming: torch.Tensor = field(default_factory=_no_rows)
    out_cuts: list[tuple[slice, list[int]]] = field(default_factory=list)
    in_cuts: list[tuple[slice, list[int]]] = field(default_factory=list)


class AllToAllDispatcher(Dispatcher[AllToAllState]):
    name = "torch"

    def __init__(
        self,
        group: Group,
        num_experts: int,
        link: ModelledLink | None = None,
        timeline: Timeline | None = None,
    ):
        self.group, self.ep, self.link = group, group.size, link
        self.num_experts, self.local = num_experts, num_experts // group.size
        self.timeline = timeline  # records each all-to-all from launch to completion
        self.comm = CommStream(group.device)  # CUDA: the communication stream; CPU: no-op
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
    ) -> InFlight:
        """Start one all-to-all of ``rows`` on the communication stream. ``crossing``: the
        rows that leave this rank and arrive from others, where the splits do not say (the
        low-latency layout's fixed splits carry padding the link never sees)."""
        me = self.group.rank
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        sent, received = (sum(n) - n[me] for n in (send, recv))
        if crossing is not None:
            sent = received = crossing
        off_rank = max(sent, received) * row_bytes
        link, done = self.link, None
        timed = self.timeline is not None and self.timeline.enabled and self.comm.on_gpu
        with self.comm.launch():
            began = self.comm.done(timing=True) if timed else None
            # rows (dispatch's sorted rows, combine's outputs, an SBO piece) came from the
            # compute stream and are read here: without this the allocator could hand their
            # memory to the next compute-stream allocation while the transfer still reads it
            self.comm.hold(rows)
            handle = self.group.all_to_all(rows, send, recv, async_op=True)
            if self.comm.on_gpu:  # the stream, not the host, waits for the rows and the link
                handle.wait()
                if link is not None:
                    self.comm.delay(link.latency_s + off_rank / link.bytes_per_s)
                link, done = None, self.comm.done(timing=timed)
        out_mb, in_mb = sent * row_bytes / 1e6, received * row_bytes / 1e6
        label = f"{kind} {off_rank / 1e6:.2f} MB ({owner}; {out_mb:.2f} out, {in_mb:.2f} in)"
        return InFlight(handle, link, off_rank, owner, self.timeline, label, done, began)

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = "mb0",
        extend: bool = True,
    ) -> AllToAllState:
        order, rows, counts = sort_by_expert(hidden, topk_ids, self.num_experts)
        # the dispatch's one read of the device; the counts are then exchanged on the host
        # (gloo beside NCCL), never queued behind an all-to-all still on the device
        counts = read_counts(counts, order.numel()).view(self.ep, self.local)
        start = time.perf_counter()
        everyone = self.exchange_counts(counts)
        if self.timeline is not None:  # a blocking exchange: the ranks meet here
            self.timeline.add(f"{owner} wait", "counts exchange", start, time.perf_counter())
        recv_counts = everyone[:, self.group.rank].contiguous()  # [p, e]: rank p to my e
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        state = AllToAllState(
            hidden.shape[0],
            topk_weights,
            order,
            owner,
            counts=counts,
            recv_counts=recv_counts,
            all_counts=everyone,
            send=send,
            recv=recv,
        )
        state.pending = self._start("dispatch", rows, send, recv, owner)
        return state

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
        state.expert_inputs = received[state.perm]
        state.tokens_per_expert = recv_counts.sum(0).tolist()

    def combine_a(self, state: AllToAllState) -> None:
        rows = outputs(state)
        back = torch.empty_like(rows)
        back[state.perm] = rows  # back to the order they came in
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
            row_of = torch.empty_like(state.perm)  # each received row's row among the outputs
            row_of[state.perm] = torch.arange(state.perm.numel(), device=state.perm.device)
            state.outgoing_rows = row_of[outgoing]
        (cut, send), (into, recv) = state.out_cuts[block], state.in_cuts[block]
        rows = expert_outputs[state.outgoing_rows[cut]]
        kind = f"combine piece {len(pieces.pieces)}"
        pieces.pieces.append(
            (self._start(kind, rows, send, recv, state.owner), state.incoming[into])
        )
