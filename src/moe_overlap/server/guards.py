"""What stands before every route: the API key, the body-size bound, and errors in OpenAI's
shape (``{"error": {"message", "type", "code"}}``) with a 4xx or 503 status."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_overlap.engine.loop import EngineDead
from moe_overlap.engine.request import InvalidRequestError

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
# what load balancers, scrapers and readers of the docs reach without the API key
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/openapi.json"})
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_tokens: int | None = None  # None: the model's context less one token


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = {"message": message, "type": ERROR_TYPES.get(status, "error"), "code": code}
    return JSONResponse({"error": body}, status_code=status)


def install_guards(app: FastAPI, settings: ServerSettings) -> None:
    app.add_middleware(Guard, settings=settings)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code)

    @app.exception_handler(InvalidRequestError)
    async def invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_value")

    @app.exception_handler(EngineDead)
    async def dead(request: Request, exc: EngineDead) -> JSONResponse:
        return error_response(503, f"the engine stopped: {exc}", "engine_dead")

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid')}", "invalid_value")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None)


class Guard:
    """ASGI middleware: the API key (every path but OPEN_PATHS), then the body read whole up to
    ``max_request_bytes`` and replayed to the app."""

    def __init__(self, app: ASGIApp, settings: ServerSettings):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if not self._authorized(scope["path"], headers.get(b"authorization", b"")):
            msg = "a valid API key is required: send the header 'Authorization: Bearer KEY'"
            return await error_response(401, msg, "invalid_api_key")(scope, receive, send)
        limit = self.settings.max_request_bytes
        too_large = error_response(
            400, f"the request body is larger than --max-request-bytes={limit}", "too_large"
        )
        declared = headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > limit:
            return await too_large(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await too_large(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)

    def _authorized(self, path: str, header: bytes) -> bool:
        key = self.settings.api_key
        if key is None or path in OPEN_PATHS:
            return True
        return secrets.compare_digest(header, f"Bearer {key}".encode())
