"""An ``LLM`` behind uvicorn: the engine loop on its thread, the HTTP server on the caller's.

In the main thread uvicorn turns SIGINT and SIGTERM into a graceful stop (then re-raises them),
and ``run`` stops the engine and every rank on the way out. When a rank dies the server answers
503 and stops, and ``run`` raises ``EngineStopped`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator

import uvicorn

from moe_overlap.engine.llm import LLM
from moe_overlap.engine.loop import EngineLoop
from moe_overlap.server.app import build_app
from moe_overlap.server.guards import ServerSettings

GRACEFUL_S = 3.0  # how long open streams may finish once a stop is asked for
DYING_S = 1.0  # how long a server whose engine died answers 503 before it exits


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
    ):
        self.engine = EngineLoop(llm)
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
        )
        self.http = uvicorn.Server(config)

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
        """Ask the server to stop (from any thread); ``run`` returns once it has."""
        self.http.should_exit = True

    async def _serve(self) -> None:
        watch = asyncio.create_task(self._watch_engine())
        throughput = asyncio.create_task(self.metrics.log_throughput())
        try:
            await self.http.serve()
        finally:
            watch.cancel()
            throughput.cancel()

    async def _watch_engine(self) -> None:
        while not self.engine.error:
            await asyncio.sleep(0.1)
        await asyncio.sleep(DYING_S)  # requests until then are answered 503
        self.http.should_exit = True


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
