"""An ``LLM`` behind uvicorn: the engine loop on its thread, the HTTP server on the caller's.

SIGINT or SIGTERM (or ``stop()``) drains: new requests get 503 with ``Retry-After``, those in
flight may finish for ``shutdown_timeout``, then the rest hear that the server is shutting
down (streams an error event and ``[DONE]``, whole answers a 503) before the ranks stop; a
second SIGINT stops at once. uvicorn re-raises the signal once it has stopped, and ``run``
stops the engine and every rank on the way out. When a rank dies the server answers 503 and
stops, and ``run`` raises ``EngineStopped`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_overlap.engine.llm import LLM
from moe_overlap.engine.loop import EngineLoop
from moe_overlap.server.app import build_app
from moe_overlap.server.guards import RETRY_AFTER_S, ServerSettings, error_body

GRACEFUL_S = 3  # uvicorn's wait for connections once every request was answered
DYING_S = 1.0  # how long a server whose engine died answers 503 before it exits
POLL_S = 0.05
_BUSY_BODY = json.dumps(
    error_body(503, "too many connections are open; retry shortly", "server_busy")
).encode()
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
    % (RETRY_AFTER_S, len(_BUSY_BODY), _BUSY_BODY)
)


class EngineStopped(RuntimeError):
    """The server stopped because the engine did (a rank failed)."""


class Server:
    def __init__(
        self,
        llm: LLM,
        settings: ServerSettings,
        host: str = "127.0.0.1",
        port: int = 8000,
        log_level: str = "warning",
        on_started: Callable[[], None] | None = None,
    ):
        self.engine = EngineLoop(llm, record_every=settings.metrics_record_every)
        self.settings, self.on_started = settings, on_started
        self.app = build_app(self.engine, settings)
        self.metrics = self.app.state.metrics
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,  # observability.py logs each request with its tokens and time
            timeout_graceful_shutdown=GRACEFUL_S,
            lifespan="off",
            http=_guarded_http(settings.header_timeout, settings.max_connections),
        )
        self.http = _Http(config)

    @property
    def started(self) -> bool:
        return self.http.started

    def run(self) -> None:
        """Serve until stopped (a signal, ``stop()``, or a dead rank); then stop the engine."""
        self.engine.start()
        try:
            with _sigterm_unwinds():
                asyncio.run(self._serve())
        finally:
            self.engine.stop()
        if self.engine.error:
            raise EngineStopped(f"the engine stopped: {self.engine.error}")

    def stop(self) -> None:
        """Ask the server to drain and stop (from any thread); ``run`` returns once it has."""
        self.http.draining = True

    async def _serve(self) -> None:
        tasks = [self._watch_engine, self._drain, self._told, self.metrics.log_throughput]
        running = [asyncio.create_task(t()) for t in tasks]
        try:
            await self.http.serve()
        finally:
            for task in running:
                task.cancel()

    async def _told(self) -> None:
        while not self.http.started:
            await asyncio.sleep(POLL_S)
        if self.on_started is not None:
            self.on_started()  # only now: the address is bound

    async def _watch_engine(self) -> None:
        while not self.engine.error:
            await asyncio.sleep(0.1)
        await asyncio.sleep(DYING_S)  # requests until then are answered 503
        self.http.should_exit = True

    async def _drain(self) -> None:
        while not self.http.draining:
            await asyncio.sleep(POLL_S)
        gate = self.app.state.gate
        gate.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout
        while gate.in_flight and loop.time() < deadline and not self.http.should_exit:
            await asyncio.sleep(POLL_S)
        await asyncio.to_thread(self.engine.stop)  # the rest hear SHUTTING_DOWN
        while gate.in_flight and not self.http.should_exit:
            await asyncio.sleep(POLL_S)  # their last words are being written
        self.http.should_exit = True


class _Http(uvicorn.Server):
    """uvicorn, with a first signal that drains (``Server._drain``) rather than stops."""

    draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining:
            self._captured_signals.append(sig)
            self.draining = True
        else:
            super().handle_exit(sig, frame)


def _guarded_http(timeout_s: float, max_connections: int) -> type[H11Protocol]:
    class GuardedHTTP(H11Protocol):
        """uvicorn's HTTP/1.1 with a cap on open connections (one past it gets a JSON 503 and
        is closed) and a deadline for each request's headers (from the connection or the last
        response): a client that trickles them is dropped, not held."""

        timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_BUSY)
                transport.close()
                return
            self.timer = self.loop.call_later(timeout_s, self.headers_late)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_later(timeout_s, self.headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.timer is not None:
                self.timer.cancel()
            super().connection_lost(exc)

        def headers_late(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTP


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """uvicorn re-raises the SIGTERM it caught once it has stopped; make that an exception that
    unwinds (stopping the ranks) rather than the default instant death."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
