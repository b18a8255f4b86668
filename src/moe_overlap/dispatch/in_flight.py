"""An all-to-all in flight, as the all-to-all dispatchers hand it to a ``_b`` step: one
transfer (``InFlight``), or a combine sent in pieces (``CombinePieces``)."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from moe_overlap.core import tracks
from moe_overlap.core.dispatcher import Pending
from moe_overlap.core.timeline import Timeline
from moe_overlap.distributed.comm import CommHandle
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.distributed.streams import consume


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
        self.start, self.num_bytes = time.perf_counter(), num_bytes
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
        with recording.span(tracks.wait(who), label) if recording is not None else nullcontext():
            out = consume(self.done, self.handle.wait())  # every waiter's stream waits
            if self.link is not None:
                self.link.sleep_until(self.earliest_end)
        if recording is not None and self.began is not None:
            self.recording = None  # on the GPU: its length from the stream's events
            recording.add_later(tracks.COMM, self.label, self._gpu_span)
        elif recording is not None:
            self.recording = None  # one span per all-to-all, at its first wait
            now = time.perf_counter()
            end = now if self.completed_at is None else min(self.completed_at, now)
            recording.add(tracks.COMM, self.label, self.start, end, self.num_bytes)
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
