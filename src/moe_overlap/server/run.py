"""An ``LLM`` behind uvicorn: the engine loop on its thread, the HTTP server on the caller's.

SIGINT or SIGTERM (or ``stop()``) drains: new requests get 503 with ``Retry-After``, those in
flight may finish for ``shutdown_timeout``, then the rest hear that the server is shutting
down (streams an error event and ``[DONE]``, whole answers a 503) before the ranks stop; a
second SIGINT stops at once. uvicorn re-raises the signal once it has stopped, and ``run``
stops the engine and every rank on the way out, whatever closing the engine raises. When a rank
or the ranks' fork server dies the server answers 503 and stops, and ``run`` raises
``EngineStopped`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.loop import EngineLoop
from moe_overlap.server.app import build_app
from moe_overlap.server.connections import ConnectionCaps, guarded_http
from moe_overlap.server.guards import ServerSettings
from moe_overlap.server.observability import logger

GRACEFUL_S = 3  # uvicorn's wait for connections once every request was answered
DYING_S = 1.0  # how long a server whose engine died answers 503 before it exits
POLL_S = 0.05


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
        sock: socket.socket | None = None,
    ):
        """``sock``: a socket already bound (``listening_socket``) to serve on, instead of
        binding ``host`` and ``port`` now."""
        self.engine = EngineLoop(llm, record_every=settings.metrics_record_every)
        self.settings, self.on_started, self.sock = settings, on_started, sock
        self.app = build_app(self.engine, settings)
        self.metrics = self.app.state.metrics
        caps = (settings.max_connections, settings.max_connections_per_client)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,  # observability.py logs each request with its tokens and time
            timeout_graceful_shutdown=GRACEFUL_S,
            lifespan="off",
            http=guarded_http(settings.header_timeout, ConnectionCaps(*caps)),
        )
        self.http = _Http(config)

    @property
    def started(self) -> bool:
        return self.http.started

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one the system chose for port 0)."""
        return self.http.servers[0].sockets[0].getsockname()[1]

    def run(self) -> None:
        """Serve until stopped (a signal, ``stop()``, or a dead rank); then stop the engine."""
        self.engine.start()
        try:
            with _sigterm_unwinds():
                asyncio.run(self._serve())
        finally:
            self._stop_engine()
            if self.engine.error:  # the news, even when a signal was stopping the server too
                raise EngineStopped(f"the engine stopped: {self.engine.error}")

    def stop(self) -> None:
        """Ask the server to drain and stop (from any thread); ``run`` returns once it has."""
        self.http.draining = True

    async def _serve(self) -> None:
        tasks = [self._watch_engine, self._drain, self._told, self.metrics.log_throughput]
        running = [asyncio.create_task(t()) for t in tasks]
        try:
            await self.http.serve(sockets=None if self.sock is None else [self.sock])
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
        try:
            await asyncio.to_thread(self._stop_engine)  # the rest hear SHUTTING_DOWN
            while gate.in_flight and not self.http.should_exit:
                await asyncio.sleep(POLL_S)  # their last words are being written
        finally:
            self.http.should_exit = True

    def _stop_engine(self) -> None:
        """Stop the engine and its ranks; a failure to close is logged, and shutdown goes on."""
        try:
            self.engine.stop()
        except Exception as exc:
            logger.error("stopping the engine failed: %s: %s", type(exc).__name__, exc)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one), for a server to start on
    later: bound before the model loads, so a port in use is named at once, not after the
    weights are read (vLLM binds first likewise)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = (exc.strerror or str(exc)).lower()
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            fix = "give an address of this machine (127.0.0.1, or 0.0.0.0 for every interface)"
        else:
            fix = "choose another --port (0: a free one)"
        raise ConfigError(f"--host {host} --port {port}: {why}; {fix}") from None
    return sock


class _Http(uvicorn.Server):
    """uvicorn, with a first signal that drains (``Server._drain``) rather than stops."""

    draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.draining:
            self._captured_signals.append(sig)
            self.draining = True
        else:
            super().handle_exit(sig, frame)


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
