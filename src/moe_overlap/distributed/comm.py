"""Operations in flight: the handle ``Group`` returns for an async collective, the completion
of several point-to-point operations that together make one collective, sends in flight, and
the timeout every wait on them defaults to."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from itertools import accumulate
from typing import Protocol

import torch
import torch.distributed as dist


class Work(Protocol):
    """What a collective in flight offers: ``dist.Work``, or ``Works`` for several."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def is_completed(self) -> bool: ...

    def get_future(self) -> torch.futures.Future: ...


# waits for one work within a timeout (seconds, None: the group's), naming the operation
WaitFn = Callable[[Work, str, float | None], None]


class CollectiveTimeout(RuntimeError):
    """A collective or point-to-point operation did not finish within its timeout."""


class CollectiveAborted(RuntimeError):
    """A collective asked of a group that was given up (``Group.abort``)."""


class CommHandle:
    """An operation in flight. ``wait`` returns its output; a second ``wait`` returns it again
    and costs nothing (the work, and the tensors it keeps, are released by the first)."""

    def __init__(self, wait: WaitFn, work: Work | None, output: torch.Tensor, op: str) -> None:
        self._wait_fn, self._work, self._output, self._op = wait, work, output, op
        # CUDA: the stream that waited first, and an event after that wait on it
        self._waited: tuple[torch.cuda.Stream, torch.cuda.Event] | None = None

    def on_complete(self, callback) -> None:
        """Call ``callback()`` when the operation completes (from the communication thread)."""
        if self._work is None:
            callback()
        else:
            self._work.get_future().then(lambda _: callback())

    def is_completed(self) -> bool:
        """True once ``wait`` would return without blocking."""
        return self._work is None or self._work.is_completed()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until done, at most ``timeout`` seconds (default: the group's timeout).

        Raises ``CollectiveTimeout`` when the limit passes; the group is unusable afterwards.
        """
        if self._work is not None and self._output.is_cuda and timeout is None:
            # NCCL: the caller's stream waits on the collective, the host does not (a wait
            # with a timeout would block the host); NCCL's watchdog enforces the group timeout
            self._work.wait()
            stream = torch.cuda.current_stream(self._output.device)
            event = torch.cuda.Event()
            event.record(stream)
            self._work, self._waited = None, (stream, event)
        elif self._work is not None:
            self._wait_fn(self._work, self._op, timeout)
            self._work = None  # done: later waits return at once
        elif self._waited is not None:  # a later waiter's stream follows the first's
            stream, event = self._waited
            current = torch.cuda.current_stream(self._output.device)
            if current != stream:
                current.wait_event(event)
        return self._output


class Works:
    """Several point-to-point operations that together make one collective.

    gloo's send/recv works have no future, and two threads must never wait on the same one,
    so once a completion callback is wanted a single waiter thread owns the waiting.
    """

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works
        self._waiter: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None  # made when a callback is wanted

    def wait(self, timeout: timedelta | None = None) -> bool:
        """``timeout`` None: the works' own (NCCL's watchdog enforces the group's)."""
        if self._waiter is None:
            waits = (w.wait() if timeout is None else w.wait(timeout=timeout) for w in self.works)
            return all(finished is not False for finished in waits)
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("timed out waiting for the send/recv operations")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set() if self._waiter else all(w.is_completed() for w in self.works)

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            self._waiter = threading.Thread(target=self._wait_all, daemon=True)
            self._waiter.start()
        return self._future

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except BaseException as exc:  # handed to the caller's wait
            self._error = exc
        if self._error is None and self._future is not None:  # callbacks run before any wait
            self._future.set_result(None)
        self._done.set()


class Sending:
    """Sends in flight; holds their buffers until ``wait`` has seen every one complete."""

    def __init__(
        self, wait: WaitFn, works: list[dist.Work], frames: list[torch.Tensor], dst: int
    ) -> None:
        self._wait_fn, self.works, self.frames, self.dst = wait, works, frames, dst

    def wait(self) -> None:
        for work in self.works:
            self._wait_fn(work, f"send_dict to group rank {self.dst}", None)
        self.works, self.frames = [], []


def all_to_all_p2p(
    pg: dist.ProcessGroup,
    ranks: list[int],
    out: torch.Tensor,
    input: torch.Tensor,
    ins: list[int],
    outs: list[int],
) -> Works:
    """``Group.all_to_all`` as point-to-point operations (gloo), this rank's own rows copied;
    a peer it sends no rows, or receives none from, gets no operation at all."""
    # Every receive is posted before any send: gloo's own all-to-all posts sends first and
    # then, over a shaped link, sometimes takes twice size/rate.
    src, dst = _offsets(ins), _offsets(outs)
    me, works = dist.get_rank(pg), []
    for p in range(len(ranks)):
        if p != me and outs[p]:
            works.append(issued(dist.irecv(out[dst[p] : dst[p] + outs[p]], ranks[p], pg)))
    input = input.contiguous()
    for p in range(len(ranks)):
        if p != me and ins[p]:
            works.append(issued(dist.isend(input[src[p] : src[p] + ins[p]], ranks[p], pg)))
    out[dst[me] : dst[me] + outs[me]] = input[src[me] : src[me] + ins[me]]
    return Works(works)


def _offsets(splits: list[int]) -> list[int]:
    return list(accumulate(splits, initial=0))[:-1]


def abort_process_groups() -> None:
    """Abort every process group of this process (torch's ``_abort_process_group``): NCCL then
    fails the collectives in flight, so a thread left inside one neither waits for peers that
    moved on nor holds up the process's teardown. gloo ignores it (torch 2.13: its waits
    continue), so a ``Group`` also refuses collectives itself once aborted."""
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            dist.distributed_c10d._abort_process_group()


def issued(work: dist.Work | None) -> dist.Work:
    """The work of an operation on a group this rank belongs to (torch returns None otherwise)."""
    if work is None:
        raise RuntimeError("a point-to-point operation was issued on a group without this rank")
    return work


def default_group_timeout() -> timedelta:
    """The timeout given to ``dist.init_process_group``; torch does not pass it on to new groups."""
    for device in ("cpu", "cuda"):
        try:
            world = dist.group.WORLD
            assert world is not None, "called before init_process_group"
            return world._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return dist.default_pg_timeout
