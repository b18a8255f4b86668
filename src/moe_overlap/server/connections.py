"""uvicorn's HTTP/1.1 with the server's connection guards, applied before any request is read:
a cap on open connections, all clients together and per client (by peer address), each
connection past either answered with a JSON 503 and closed; and a deadline for each request's
headers, so a client that trickles them is dropped, not held."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from moe_overlap.server.guards import RETRY_AFTER_S, error_body


def _busy(message: str) -> bytes:
    body = json.dumps(error_body(503, message, "server_busy")).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: %d\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
        % (RETRY_AFTER_S, len(body), body)
    )


_BUSY = _busy("too many connections are open; retry shortly")
_CLIENT_BUSY = _busy("this client has too many connections open; retry shortly")


@dataclass
class ConnectionCaps:
    """The connections admitted now, in all and per peer address (event loop only)."""

    total: int
    per_client: int
    open: Counter[str] = field(default_factory=Counter)

    def admit(self, peer: str) -> bytes | None:
        """None if a connection from ``peer`` is admitted (and counted), else the 503 to send."""
        if self.open[peer] >= self.per_client:
            return _CLIENT_BUSY
        if self.open.total() >= self.total:
            return _BUSY
        self.open[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.open[peer] -= 1
        if not self.open[peer]:
            del self.open[peer]


def guarded_http(header_timeout: float, caps: ConnectionCaps) -> type[H11Protocol]:
    class GuardedHTTP(H11Protocol):
        timer: asyncio.TimerHandle | None = None
        peer: str | None = None  # set once admitted

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            address = transport.get_extra_info("peername")
            peer = str(address[0]) if isinstance(address, tuple) else str(address)
            refusal = caps.admit(peer)
            if refusal is not None:
                transport.write(refusal)
                transport.close()
                return
            self.peer = peer
            self.timer = self.loop.call_later(header_timeout, self.headers_late)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timer is not None:
                self.timer.cancel()
            self.timer = self.loop.call_later(header_timeout, self.headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.timer is not None:
                self.timer.cancel()
            if self.peer is not None:
                caps.release(self.peer)
                self.peer = None
            super().connection_lost(exc)

        def headers_late(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return GuardedHTTP
