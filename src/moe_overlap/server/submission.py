"""The requests of one HTTP call, as seen from the event loop: their deltas arrive on an asyncio
queue, and whatever has not finished when the call ends (a client gone) is aborted.

Requests may be added from a worker thread (the server prepares a call off the event loop);
one added after ``close`` is aborted at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from moe_overlap.engine.loop import Delta, EngineLoop
from moe_overlap.engine.request import SamplingParams

CHECK_S = 0.25  # how often a client is checked for having gone away


class Submission:
    def __init__(self, engine: EngineLoop):
        self.engine = engine
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.pending: dict[int, int] = {}  # choice index -> request id, until it finishes
        self.closed = False
        self._lock = threading.Lock()  # add (a worker thread) against close (the event loop)

    def add(self, index: int, prompt: list[int], params: SamplingParams, where: str) -> None:
        """Queue choice ``index``; InvalidRequestError names ``where`` (its prompt) if bad."""

        def listener(delta: Delta) -> None:  # runs on the engine's thread
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, delta))

        req = self.engine.submit(prompt, params, listener, where=where)
        with self._lock:
            if not self.closed:
                self.pending[index] = req.request_id
                return
        self.engine.abort(req.request_id)

    async def deltas(
        self, disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[tuple[int, Delta]]:
        """Every delta of every request, until all have finished; stops early (and the caller's
        ``close`` aborts the rest) when ``disconnected`` says the client is gone."""
        checked = time.monotonic()
        while self.pending:
            try:
                index, delta = await asyncio.wait_for(self.queue.get(), timeout=CHECK_S)
            except TimeoutError:
                delta = None
            if disconnected is not None and time.monotonic() - checked >= CHECK_S:
                if await disconnected():
                    return
                checked = time.monotonic()
            if delta is None:
                continue
            if delta.finish_reason or delta.error:
                self.pending.pop(index, None)
            yield index, delta

    def close(self) -> None:
        """Abort the requests that have not finished (their slots and KV rows are freed), and
        any added later."""
        with self._lock:
            self.closed = True
            unfinished, self.pending = list(self.pending.values()), {}
        for request_id in unfinished:
            self.engine.abort(request_id)


def choice_name(index: int, per_prompt: int) -> str:
    """How errors name choice ``index``: by its prompt when each prompt has one choice."""
    if per_prompt == 1:
        return f"prompt {index}"
    return f"choice {index} (of prompt {index // per_prompt})"
