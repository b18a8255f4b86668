"""Two micro-batches on two threads that pass a baton (vLLM's ubatch threads).

Exactly one thread runs model code at a time. At a ``Yield`` (operations.py; the strategy table
places them) a micro-batch runs the receive hook the other left for it, leaves its own, hands
the baton over and sleeps. Every wait has a timeout that names the stalled micro-batch, and an
error on either thread stops both and is re-raised in the caller. On CUDA each micro-batch
launches on its own stream and every handover is an event (``MicroBatchStreams``).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from moe_overlap.core.overlap_modes import DBO
from moe_overlap.distributed.streams import MicroBatchStreams
from moe_overlap.overlap.operations import Op, Yield, split_stages

GRACE_S = 5.0  # past a collective's own timeout, so its clearer error surfaces first
_POLL_S = 0.05  # how often the caller looks for a micro-batch that stopped making progress
Hook = Callable[[str], object]  # a receive, run by the micro-batch named by its argument
MakeHook = Callable[[Any], Hook]  # at a yield: the receive the yielding micro-batch leaves


class DboStall(RuntimeError):
    """A micro-batch held the baton too long: it neither reached a yield point nor finished."""


class _Aborted(Exception):
    """The other micro-batch failed; this one stops where it is."""


class Baton:
    """Which micro-batch may run model code, and the receive hooks each owes the other."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.owner: int | None = 0  # micro-batch 0 starts; None once both finished
        self.done = [False, False]
        self.error: BaseException | None = None
        self.hooks: list[Hook | None] = [None, None]  # hooks[i]: micro-batch i runs it
        self.hooks_registered = self.hooks_run = 0
        self.last_progress = time.monotonic()
        self._cv = threading.Condition()

    def check(self, me: int) -> None:
        """On every op entry: stop if the other failed; only the holder runs model code."""
        if self.error is not None:
            raise _Aborted
        if self.owner != me:  # not `assert`: python -O must not remove it
            raise AssertionError(
                f"DBO micro-batch {me} entered model code while micro-batch {self.owner} "
                "holds the baton"
            )
        self.last_progress = time.monotonic()

    def wait_turn(self, me: int) -> None:
        with self._cv:
            mine = self._cv.wait_for(
                lambda: self.owner == me or self.error is not None, self.timeout_s
            )
            if self.error is not None:
                raise _Aborted
            if not mine:
                raise DboStall(
                    f"DBO micro-batch {me} waited {self.timeout_s:g} s for the baton: "
                    f"micro-batch {self.owner} stalled (neither reached a yield point nor finished)"
                )
            self.last_progress = time.monotonic()

    def pass_on(self, me: int, finished: bool = False) -> None:
        """Hand the baton to the other micro-batch (to nobody once both finished)."""
        with self._cv:
            self.check(me)
            self.done[me] = finished
            self.owner = None if self.done[1 - me] else 1 - me
            self._cv.notify_all()

    def register_hook(self, me: int, hook: Hook) -> None:
        """Leave ``hook`` for the other micro-batch's next ``maybe_run_hook``."""
        other = 1 - me
        # same op lists: the other is at its previous yield and has run the previous hook
        if self.done[other] or self.hooks[other] is not None:
            raise AssertionError(f"micro-batch {other} could never run this receive hook")
        self.hooks[other] = hook
        self.hooks_registered += 1

    def maybe_run_hook(self, me: int, name: str) -> None:
        """Run the receive hook the other micro-batch left for micro-batch ``me`` (``name``)."""
        hook, self.hooks[me] = self.hooks[me], None
        if hook is not None:
            self.hooks_run += 1
            hook(name)

    def fail(self, error: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = error
            self._cv.notify_all()


class _DualRun:
    """One forward's two micro-batches: contexts, outputs, outcomes and the baton."""

    def __init__(
        self,
        ctxs: Sequence[Any],
        ops: Sequence[Op | Yield],
        make_hook: MakeHook,
        timeout_s: float,
        streams: MicroBatchStreams,
        inputs: Sequence[dict] | None = None,
    ):
        if len(ctxs) != 2:
            raise ValueError(f"DBO runs exactly two micro-batches, got {len(ctxs)}")
        self.ctxs, self.make_hook = list(ctxs), make_hook
        self.segments = split_stages(ops)  # the ops between two yields
        self.baton, self.streams = Baton(timeout_s), streams
        self.outputs: list[dict] = [dict(i) for i in inputs] if inputs else [{}, {}]
        self.outcomes: dict[int, BaseException | None] = {}
        self.results: queue.SimpleQueue = queue.SimpleQueue()

    def play(self, me: int) -> None:
        """Run micro-batch ``me`` on the calling thread; report ``(me, error or None)``."""
        error = None
        try:
            # thread-local: neither the caller's mode nor its stream reaches here
            with torch.inference_mode(), self.streams.on(me):
                self._play(me)
        except BaseException as exc:  # the caller re-raises it
            error = exc
            self.baton.fail(exc)
        self.results.put((me, error))

    def _play(self, me: int) -> None:
        baton, ctx, last = self.baton, self.ctxs[me], len(self.segments) - 1
        streams = self.streams  # the GPU follows the baton: each holder waits on the last
        baton.wait_turn(me)
        streams.take_over(me)
        for segment, ops in enumerate(self.segments):
            start = time.perf_counter()
            for op in ops:
                baton.check(me)
                self.outputs[me] = op(ctx, **self.outputs[me]) or {}
            _record(ctx, segment, start)
            baton.maybe_run_hook(me, ctx.name)  # the other's receive, now that our compute is done
            if segment == last:
                break
            baton.register_hook(me, self.make_hook(ctx))
            streams.hand_over(me)
            baton.pass_on(me)
            baton.wait_turn(me)
            streams.take_over(me)
        streams.hand_over(me)
        baton.pass_on(me, finished=True)

    def gather(self, timeout_s: float) -> bool:
        """Take reported outcomes for up to ``timeout_s``; True once both are in."""
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < 2:
            try:
                me, error = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            self.outcomes[me] = error
        return True

    def collect(self, patience_s: float, after_error_s: float) -> bool:
        """Gather both outcomes unless the baton holder makes no progress for ``patience_s``,
        or the other has not stopped ``after_error_s`` after a failure; True if both are in."""
        failed_at = None
        while not self.gather(_POLL_S):
            now = time.monotonic()
            if failed_at is None and self.error() is not None:
                failed_at = now
            if failed_at is not None and now - failed_at > after_error_s:
                return False
            if failed_at is None and now - self.baton.last_progress > patience_s:
                return False
        return True

    def error(self) -> BaseException | None:
        """The cause to re-raise: a reported error before a stall (an abort is an echo)."""
        errors = [e for e in self.outcomes.values() if e and not isinstance(e, _Aborted)]
        errors.sort(key=lambda e: isinstance(e, DboStall))
        return errors[0] if errors else self.baton.error


def _record(ctx: Any, segment: int, start: float) -> None:
    timeline = getattr(ctx, "timeline", None)
    if timeline is not None and timeline.enabled:
        timeline.add(ctx.name, f"dbo segment {segment}", start, time.perf_counter())


def _serve(jobs: queue.SimpleQueue) -> None:
    """A worker thread's life: play ``(micro-batch, run)`` jobs until it gets None."""
    while (job := jobs.get()) is not None:
        me, run = job
        run.play(me)


def _stop(jobs: list[queue.SimpleQueue], threads: list[threading.Thread]) -> None:
    for q in jobs:
        q.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=1.0)  # a thread stuck in a collective is a daemon: never wait on it


class DualBatchThreads:
    """A persistent pair of daemon threads, one per micro-batch, reused by every forward."""

    def __init__(
        self,
        timeout_s: float = 60.0,
        name: str = DBO.name,
        streams: MicroBatchStreams | None = None,
        on_stall: Callable[[str], None] | None = None,
    ):
        """``on_stall(why)`` runs before a stall is raised, while a thread may still be inside
        a collective (DBO aborts its group there, so that no peer waits on it)."""
        self.timeout_s, self.on_stall = timeout_s, on_stall
        self.streams = streams or MicroBatchStreams(torch.device("cpu"))  # CPU: no streams
        self.last_run: _DualRun | None = None
        self._stuck: _DualRun | None = None  # a run with a thread that has not reported yet
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(2)]
        self._threads = [
            threading.Thread(target=_serve, args=(q,), name=f"{name}-mb{i}", daemon=True)
            for i, q in enumerate(self._jobs)
        ]
        for t in self._threads:
            t.start()
        # the threads hold no reference to self, so this also runs when self is collected
        self._close = weakref.finalize(self, _stop, self._jobs, self._threads)

    def run(
        self,
        ctxs: Sequence[Any],
        ops: Sequence[Op | Yield],
        make_hook: MakeHook,
        inputs: Sequence[dict] | None = None,
    ) -> list[dict]:
        """Run two micro-batches (``ctxs``, each starting from its ``inputs``) through ``ops``
        (ops and ``Yield`` markers); at each yield, ``make_hook(ctx)`` is the receive the other
        micro-batch runs at its next yield. Return each one's final outputs, or re-raise the
        first error in the caller."""
        if not self._close.alive:
            raise RuntimeError("DualBatchThreads is closed")
        if self._stuck is not None and not self._stuck.gather(self.timeout_s):
            raise self._stalled(DboStall("DBO threads are still stuck in an earlier forward"))
        run = _DualRun(ctxs, ops, make_hook, self.timeout_s, self.streams, inputs)
        self.last_run = self._stuck = run
        self.streams.begin()
        for me, jobs in enumerate(self._jobs):
            jobs.put((me, run))
        if run.collect(self.timeout_s + GRACE_S, min(GRACE_S, self.timeout_s)):
            self._stuck = None
        else:  # nobody waits on a thread stuck in an op: stop it at its next op, if any
            idle = time.monotonic() - run.baton.last_progress
            run.baton.fail(
                DboStall(f"DBO micro-batch {run.baton.owner} made no progress for {idle:.1f} s")
            )
        error = run.error()
        if isinstance(error, DboStall):
            raise self._stalled(error)
        if error is not None:
            raise error
        self.streams.end()
        return run.outputs

    def _stalled(self, stall: DboStall) -> DboStall:
        if self.on_stall is not None:
            self.on_stall(str(stall))
        return stall

    def close(self) -> None:
        """Stop both threads (idempotent; also done when collected or at interpreter exit)."""
        self._close()
