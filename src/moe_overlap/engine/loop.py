"""Continuous batching for a server: one thread steps the engine while callers add and abort
requests; a request added while others run joins the batch at the next step.

Each request has a listener that hears a ``Delta`` after every step that gave it a token (its new
token ids and final text), and a last one with ``finish_reason`` or ``error`` set. ``error`` means
the engine died; a request that failed alone (``finish_reason`` "error", its reason in ``failed``)
leaves the engine serving the others. Listeners run on the engine's thread and must only hand the
delta over (e.g. ``call_soon_threadsafe``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, TypeVar

from moe_overlap.core.step import StepReply
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.online_eplb import eplb_counts
from moe_overlap.engine.request import Request, SamplingParams, TokenLogprobs
from moe_overlap.engine.speculation import Speculation, SpeculationStats

logger = logging.getLogger(__name__)
SHUTTING_DOWN = "the server is shutting down"  # the error requests hear from ``stop``
WATCH_S = 0.5  # how often the rank watcher also looks for the engine stopping
T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine stopped (a rank failed, or it was shut down); no request can be served."""


@dataclass
class Delta:
    request_id: int
    token_ids: list[int]  # tokens new since the last delta
    text: str  # text new since the last delta ("" without a tokenizer)
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None = None  # set on the request's last delta
    error: str | None = None  # the engine failed; this is the request's last delta
    failed: str | None = None  # this request alone failed; this is its last delta
    logprobs: list[TokenLogprobs] | None = None  # of its new tokens, when asked
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta, when asked
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (their prefill skipped)


Listener = Callable[[Delta], None]


class EngineLoop:
    """Drives ``llm`` from a thread of its own. ``llm`` must not be used directly meanwhile."""

    def __init__(self, llm: LLM, record_every: int = 0):
        self.llm = llm
        self.record_every = record_every  # every Nth step records the ranks' timelines
        self._steps = 0
        self._wake = threading.Condition()
        self._new: list[tuple[Request, Listener]] = []
        self._aborted: set[int] = set()
        self._calls: list[tuple[Callable[[], Any], Future]] = []  # run between steps
        self._live: dict[int, tuple[Request, Listener]] = {}  # engine thread only
        self._told: dict[int, int] = {}  # per live request: output tokens told so far
        self._stopping = False
        self.error: str | None = None  # why the engine died, once it has
        self._down: str | None = None  # a rank died while the engine was idle (the watcher)
        self._step_since: float | None = None  # when the step now running began
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # called on the engine's thread with each step's reply (the metrics count its modes)
        self.step_listeners: list[Callable[[StepReply], None]] = []

    def start(self) -> EngineLoop:
        self._thread.start()
        if self.llm.executor.sentinels():
            threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()
        return self

    def health(self) -> str | None:
        """Why the engine cannot serve now (a dead or stopped rank, a step stuck longer than
        the collective timeout), or None."""
        executor = self.llm.executor
        trouble = None if self.error else executor.health()
        since, limit = self._step_since, getattr(executor, "timeout_s", None)
        if trouble is None and since is not None and limit is not None:
            running = time.monotonic() - since
            if running > limit:
                trouble = (
                    f"a step has run {running:.0f} s, past the collective timeout ({limit:g} s)"
                )
        return trouble

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        listener: Listener,
        where: str = "prompt",
    ) -> Request:
        """Check the request (InvalidRequestError names ``where``) and queue it."""
        req = self.llm.make_request(where, prompt, params)
        with self._wake:
            if self.error or self._stopping:
                raise EngineDead(self.error or "the engine is shutting down")
            self._new.append((req, listener))
            self._wake.notify()
        return req

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's thread between two steps (the ranks take one message at a
        time) and return what it returns; blocks the calling thread until then."""
        done: Future = Future()
        with self._wake:
            if self.error or self._stopping:
                raise EngineDead(self.error or "the engine is shutting down")
            self._calls.append((fn, done))
            self._wake.notify()
        return done.result()

    def abort(self, request_id: int) -> None:
        """Drop a request wherever it is; its slot and KV cache row are freed at the next step."""
        with self._wake:
            self._aborted.add(request_id)
            self._wake.notify()

    def flush_cache(self) -> None:
        """Forget every cached prefix before the next step, without waiting for it (pages in
        use go when their requests end); run before the requests that arrived with it, so none
        of them finds a page cached earlier."""
        with self._wake:
            self._calls.append((self._flush_prefixes, Future()))
            self._wake.notify()

    def _flush_prefixes(self) -> None:
        flushed = sum(cache.flush() for cache in self.llm.scheduler.prefix)
        logger.info("prefix cache flushed: %d cached pages freed", flushed)

    def stats(self) -> dict[str, int]:
        """Counts for /metrics and /get_server_info: free pages include cached ones no request
        holds (evicted when needed, as vLLM counts them); prefix-cache queries and hits are
        prompt tokens looked up and found since the start."""
        sched = self.llm.scheduler
        return {
            "running": sum(len(r) for r in sched.running),
            "waiting": len(sched.waiting) + len(self._new),
            "free_slots": sum(len(s) for s in sched.slots),
            "total_slots": sum(s.num_slots for s in sched.slots),
            "free_pages": sum(c.budget.free + c.evictable for c in sched.prefix),
            "total_pages": sum(p.total for p in sched.pages),
            "preemptions": sched.preemptions,
            "prefix_cache_queries": sum(c.queries for c in sched.prefix),
            "prefix_cache_hits": sum(c.hits for c in sched.prefix),
            "cached_pages": sum(len(c.pages) for c in sched.prefix),
            **_speculation_counts(sched.speculation),
            **eplb_counts(self.llm.eplb),
        }

    def stop(self) -> None:
        """Stop stepping (requests still running hear an error), then close the engine."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join()
        self.llm.close()

    def _run(self) -> None:
        try:
            while self._take_inbox():
                if self.llm.scheduler.has_work():
                    self._step_since = time.monotonic()
                    self._steps += 1
                    every = self.record_every
                    done = self.llm.step(record=every > 0 and self._steps % every == 0)
                    self._step_since = None
                    self._heard(self.llm.last_reply)
                    for req in done:
                        self._tell(req)
        except BaseException as exc:  # a rank failed: every request hears why
            with self._wake:
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._step_since = None
        with self._wake:
            self._live.update({r.request_id: (r, cb) for r, cb in self._new})
            self._new.clear()
            for _, pending in self._calls:
                pending.set_exception(EngineDead(self.error or SHUTTING_DOWN))
            self._calls.clear()
        for req, listener in self._live.values():  # before closing: that may wait on a rank
            listener(_delta(req, [], "", error=self.error or SHUTTING_DOWN))
        self._live.clear()
        if self.error:
            try:
                self.llm.close()
            except Exception as exc:  # the ranks are gone all the same; say why in one line
                logger.error("closing the engine failed: %s: %s", type(exc).__name__, exc)

    def _heard(self, reply: StepReply | None) -> None:
        if reply is None:
            return
        for hear in self.step_listeners:
            hear(reply)

    def _watch(self) -> None:
        """Wake the loop when a rank process ends, so an idle engine notices at once."""
        sentinels = self.llm.executor.sentinels()
        while not (self._stopping or self.error):
            if wait(sentinels, timeout=WATCH_S):
                with self._wake:
                    self._down = self.llm.executor.health() or "a rank process ended"
                    self._wake.notify()
                return

    def _take_inbox(self) -> bool:
        """Add new requests and drop aborted ones; wait while there is nothing to do. False
        when the loop must stop."""
        with self._wake:
            while not (self._stopping or self._new or self._aborted or self._down or self._calls):
                if self.llm.scheduler.has_work():
                    break
                self._wake.wait()
            if self._stopping:
                return False
            if self._down:
                raise EngineDead(self._down)
            new, self._new = self._new, []
            aborted, self._aborted = self._aborted, set()
            calls, self._calls = self._calls, []
        for fn, done in calls:
            try:
                done.set_result(fn())
            except Exception as exc:  # the caller hears it; the engine goes on
                done.set_exception(exc)
        for req, listener in new:
            self._live[req.request_id] = (req, listener)
            self.llm.scheduler.add(req)
        gone = [self._live.pop(i)[0] for i in aborted if i in self._live]
        for i in aborted:
            self._told.pop(i, None)
        self.llm.scheduler.abort(gone)
        return True

    def _tell(self, req: Request) -> None:
        entry = self._live.get(req.request_id)
        if entry is None:
            return
        done = req.finish_reason is not None
        if req.error is not None:
            entry[1](_delta(req, [], "", finish_reason="error", failed=req.error))
        else:
            text = req.text.delta(final=done) if req.text is not None else ""
            params = req.params
            # every token since its last delta (a verify step gives several)
            told = self._told.pop(req.request_id, 0)
            new = req.output_ids[told:] if params.max_new_tokens else []  # 0: only scored
            self._told[req.request_id] = len(req.output_ids)
            delta = _delta(req, new, text, finish_reason=req.finish_reason)
            if params.logprobs is not None:
                delta.logprobs = req.logprobs[-len(new) :] if new else []
            if params.prompt_logprobs is not None and not req.told:
                delta.prompt_logprobs = list(req.prompt_logprobs)
            req.told = True
            entry[1](delta)
        if done:
            del self._live[req.request_id]
            self._told.pop(req.request_id, None)


def _delta(req: Request, ids: list[int], text: str, **kw) -> Delta:
    return Delta(
        req.request_id, ids, text, req.prompt_len, len(req.output_ids), **kw,
        cached_tokens=req.cached_tokens,
    )  # fmt: skip


def _speculation_counts(speculation: Speculation | None) -> dict[str, int]:
    """Speculative decoding's totals (zeros without it): verifications, drafts, accepted."""
    stats = speculation.stats if speculation is not None else SpeculationStats()
    return {
        "spec_verifications": stats.verifications,
        "spec_draft_tokens": stats.draft_tokens,
        "spec_accepted_tokens": stats.accepted_tokens,
    }
