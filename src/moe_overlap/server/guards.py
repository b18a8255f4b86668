"""What stands before every route: the API key, the bounded body read, and errors in OpenAI's
shape (``{"error": {"message", "type", "code", "param"}}``) for every failure, expected or not.

The body is read whole before a route sees it, within ``body_timeout`` (408 after), up to
``max_request_bytes`` (413), and only while the bytes received of the bodies being read all
together stay within ``max_buffered_bytes`` (503): slow or stalled uploads cannot grow the server
without bound, and a declared ``Content-Length`` reserves nothing until its bytes arrive. A 413
first reads and drops the rest of a body of up to ``DRAIN_BYTES``, so a client that sends its
whole body before reading (Python's ``http.client``) reads the 413 rather than a reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_overlap.engine.loop import EngineDead
from moe_overlap.engine.request import InvalidRequestError
from moe_overlap.server.settings import DEFAULT_MAX_REQUEST_BYTES, ServerSettings

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ServerSettings"]
# what load balancers, scrapers and readers of the docs reach without the API key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/openapi.json"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}
RETRY_AFTER_S = 5  # what a 503 from a busy or stopping server asks clients to wait
DRAIN_BYTES = 16 << 20  # most of an oversized body read and dropped before its 413


class APIError(Exception):
    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else {}
    if status in (408, 413) or code == "server_busy":  # the body was not read: close
        headers["Connection"] = "close"
    return JSONResponse(error_body(status, message, code, param), status, headers=headers)


@dataclass
class Gate:
    """Shared by the middleware and the server: open, or draining for a shutdown."""

    draining: bool = False
    buffered: int = 0  # bytes received of the bodies being read now, all requests together
    in_flight: int = 0  # requests past the gate, not yet answered


def install_guards(app: FastAPI, settings: ServerSettings) -> Gate:
    gate = Gate()
    app.add_middleware(Guard, settings=settings, gate=gate)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_value", exc.field)

    @app.exception_handler(EngineDead)
    async def dead(request: Request, exc: EngineDead) -> JSONResponse:
        return error_response(503, f"the engine stopped: {exc}", "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is the offset where parsing stopped
            at, why = first["loc"][-1], first.get("ctx", {}).get("error", "")
            message = f"the request body is not valid JSON: {why} (at character {at})"
            return error_response(400, message, "invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        message = f"{where}: {first.get('msg', 'invalid')}"
        return error_response(400, message, "invalid_value", loc[0] if loc else None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)  # anything else: still a JSON error, never plain text
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {str(exc)[:200]}"
        return error_response(500, message, "internal_error")

    return gate


class Guard:
    """ASGI middleware: a draining server's 503, the API key (every path but OPEN_PATHS),
    then the body read whole within the bounds above and replayed to the app."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, gate: Gate):
        self.app, self.settings, self.gate = app, settings, gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.gate.in_flight += 1
        try:
            return await self._guarded(scope, receive, send)
        finally:
            self.gate.in_flight -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.gate.draining:
            reply = error_response(503, "the server is shutting down", "shutting_down")
            return await reply(scope, receive, send)
        headers = dict(scope["headers"])
        if not self._authorized(scope["path"], headers.get(b"authorization", b"")):
            msg = "a valid API key is required: send the header 'Authorization: Bearer KEY'"
            return await error_response(401, msg, "invalid_api_key")(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.settings.max_request_bytes:
            drain = b"100-continue" not in headers.get(b"expect", b"").lower()
            if drain and int(declared) <= DRAIN_BYTES:  # else it would be refused unread
                await self._drain(receive)
            return await self._too_large()(scope, receive, send)
        held = [0]  # the bytes of this body received so far, counted in gate.buffered
        try:
            body = await self._read(receive, held)
        finally:
            self.gate.buffered -= held[0]
        if isinstance(body, JSONResponse):
            return await body(scope, receive, send)
        if body is None:
            return None  # the client left
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _too_large(self) -> JSONResponse:
        msg = (
            f"the request body is larger than --max-request-bytes={self.settings.max_request_bytes}"
        )
        return error_response(413, msg, "too_large")

    async def _read(self, receive: Receive, held: list[int]) -> bytes | JSONResponse | None:
        """The body, an error reply (too slow, too large, over the budget), or None (gone).
        ``held[0]`` is what it holds of ``gate.buffered``: the bytes received, as they come."""
        parts: list[bytes] = []
        deadline = asyncio.get_running_loop().time() + self.settings.body_timeout
        try:
            while True:
                message = await self._next(receive, deadline)
                if message["type"] == "http.disconnect":
                    return None
                parts.append(message.get("body", b""))
                if held[0] + len(parts[-1]) > self.settings.max_request_bytes:
                    if message.get("more_body", False):
                        await self._drain(receive, deadline, held[0] + len(parts[-1]))
                    return self._too_large()
                if self.gate.buffered + len(parts[-1]) > self.settings.max_buffered_bytes:
                    msg = "too many request bodies are being read at once; retry shortly"
                    return error_response(503, msg, "server_busy")
                self.gate.buffered += len(parts[-1])
                held[0] += len(parts[-1])
                if not message.get("more_body", False):
                    return b"".join(parts)
        except TimeoutError:
            msg = (
                f"the request body took longer than --body-timeout={self.settings.body_timeout:g} s"
            )
            return error_response(408, msg, "body_timeout")

    async def _drain(self, receive: Receive, deadline: float | None = None, seen: int = 0) -> None:
        """Read and drop the rest of a body, up to DRAIN_BYTES in all and the body timeout."""
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.settings.body_timeout
        with contextlib.suppress(TimeoutError):
            while seen <= DRAIN_BYTES:
                message = await self._next(receive, deadline)
                seen += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

    @staticmethod
    async def _next(receive: Receive, deadline: float) -> Message:
        left = deadline - asyncio.get_running_loop().time()
        return await asyncio.wait_for(receive(), timeout=max(left, 0.0))

    def _authorized(self, path: str, header: bytes) -> bool:
        key = self.settings.api_key
        if key is None or path in OPEN_PATHS:
            return True
        scheme, _, token = header.strip().partition(b" ")
        good = secrets.compare_digest(token.strip(), key.encode())
        return scheme.lower() == b"bearer" and good
