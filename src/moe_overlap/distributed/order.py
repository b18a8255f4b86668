"""One order of collectives on every rank when two threads of a rank issue them (PD multiplexing).

The prefill lane's thread and the rank's main thread (the decode batch) each issue collectives
on process groups of their own. Each lane's sequence is the same on every rank, but left alone
the threads interleave them as timing has it, differently on each rank. gloo does not mind;
NCCL does: kernels of two communicators launched in different orders on different ranks can
wait on each other forever. So while both lanes run, a ``CollectiveOrder`` makes them take
turns: each launch waits for its lane's turn, and the turn passes to the other lane after it.
When one lane ends, the other issues freely. The interleaving then depends only on how many
collectives each lane issues, which every rank of a layout has alike (idle ranks join every
collective), so every rank launches the same sequence.

An async launch holds the turn only while it launches; a blocking collective (the counts
exchange) until it returns, which holds up the other lane's next launch, never its compute.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from moe_overlap.distributed.comm import CollectiveAborted


class CollectiveOrder:
    """Turns between named lanes of one rank; ``log`` (when not None) records every launch."""

    def __init__(self, record: bool = False) -> None:
        self._cond = threading.Condition()
        self._lanes: list[str] = []  # the lanes taking turns now, in turn order
        self._turn = 0
        self.log: list[tuple[str, str]] | None = [] if record else None

    def begin(self, lanes: list[str]) -> None:
        """From now on ``lanes`` take turns, the first one first."""
        with self._cond:
            self._lanes, self._turn = list(lanes), 0
            self._cond.notify_all()

    def end(self, lane: str) -> None:
        """``lane`` issues no more collectives in this round: the others stop waiting for it."""
        with self._cond:
            if lane in self._lanes:
                i = self._lanes.index(lane)
                self._lanes.pop(i)
                if i < self._turn or self._turn >= len(self._lanes):
                    self._turn = self._turn - 1 if i < self._turn else 0
            self._cond.notify_all()

    @contextmanager
    def launch(self, lane: str, what: str) -> Iterator[None]:
        """Launch a collective of ``lane`` inside this block, in its turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._holds(lane))
            if self.log is not None:
                self.log.append((lane, what))
        try:  # the lock is not held here: a lane outside the turns never waits on another
            yield
        finally:
            with self._cond:
                if lane in self._lanes:
                    self._turn = (self._lanes.index(lane) + 1) % len(self._lanes)
                    self._cond.notify_all()

    def _holds(self, lane: str) -> bool:
        return lane not in self._lanes or self._lanes[self._turn] == lane


def first_difference(logs: list[list[tuple[str, str]]]) -> str | None:
    """None when every rank's log is the same; else where the first rank that differs from
    rank 0 parts from it."""
    for rank, log in enumerate(logs[1:], start=1):
        if log == logs[0]:
            continue
        at = next((i for i, (a, b) in enumerate(zip(logs[0], log, strict=False)) if a != b), None)
        if at is None:
            return f"rank {rank} launched {len(log)} collectives, rank 0 {len(logs[0])}"
        return f"launch {at}: rank 0 {logs[0][at]}, rank {rank} {log[at]}"
    return None


def ordered(method):
    """A ``Group`` collective that takes its lane's turn when the group has an ``order``
    (the launch, and for a blocking call its wait: the turn passes once it returns), and that
    an aborted group refuses before launching anything."""

    @functools.wraps(method)
    def run(group, *args, **kwargs):
        refuse_if_aborted(group)
        if group.order is None or group.pg is None:  # one rank: nothing is launched
            return method(group, *args, **kwargs)
        with group.order.launch(group.lane, f"{group.name} {method.__name__}"):
            return method(group, *args, **kwargs)

    return run


def refuse_if_aborted(group) -> None:
    """Raise ``CollectiveAborted`` if ``group`` was given up (``Group.abort``)."""
    if group.aborted:
        raise CollectiveAborted(
            f"group {group.name!r} (global ranks {group.ranks}) was aborted ({group.aborted}); "
            "this rank cannot run collectives any more"
        )
