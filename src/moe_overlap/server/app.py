"""The server's routes: OpenAI's /v1/completions, /v1/chat/completions (streamed over
server-sent events or whole), /v1/models and /health, over one ``EngineLoop`` and the path in
``serving.py``; SGLang's and vLLM's own routes (``native_routes.py``); /metrics and /version
(``observability.py``); the OpenAPI docs at /docs."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moe_overlap.engine.loop import EngineLoop
from moe_overlap.server.chat_prompt import chat_prompt_ids
from moe_overlap.server.checks import check_fan_out, check_fields
from moe_overlap.server.guards import APIError, ServerSettings, error_response, install_guards
from moe_overlap.server.native_routes import install_native
from moe_overlap.server.observability import install_observability, package_version
from moe_overlap.server.protocol import ChatRequest, CompletionRequest
from moe_overlap.server.serving import encode_prompt, serve


def build_app(engine: EngineLoop, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="moe-overlap", version=package_version(), redoc_url=None)
    app.state.gate = install_guards(app, settings)
    metrics = app.state.metrics = install_observability(app, engine, engine.llm.spec.overlap.mode)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.error:
            return error_response(503, f"the engine stopped: {engine.error}", "engine_dead")
        trouble = engine.health()
        if trouble:
            return error_response(503, trouble, "rank_unhealthy")
        return JSONResponse({"status": "ok", **engine.stats()})

    _install_models(app, engine, settings)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_fields(body, settings, chat=False)
        texts = body.prompts()
        check_fan_out(body, len(texts), settings)
        if body.max_tokens == 0 and not body.echo:
            message = "max_tokens=0 returns nothing without echo=true (scoring a prompt)"
            raise APIError(400, message, "invalid_value", "max_tokens")

        def encode() -> list[list[int]]:
            special = body.add_special_tokens
            return [encode_prompt(engine, p, f"prompt {i}", special) for i, p in enumerate(texts)]

        call = (body, encode, texts, body.max_tokens, False, request)
        return await serve(engine, settings, metrics, *call)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_fields(body, settings, chat=True)
        check_fan_out(body, 1, settings)
        body.use_parsers(settings.auto_tool_parser, settings.reasoning_parser)
        tok = engine.llm.tokenizer
        if tok is None:
            raise APIError(400, "chat needs a model with a tokenizer (tokenizer.json)", "no_chat")

        def encode() -> list[list[int]]:
            return [chat_prompt_ids(tok, body)]

        limit = body.max_completion_tokens or body.max_tokens
        call = (body, encode, None, limit, True, request)
        return await serve(engine, settings, metrics, *call)

    install_native(app, engine, settings, metrics)
    return app


def _install_models(app: FastAPI, engine: EngineLoop, settings: ServerSettings) -> None:
    """``/v1/models`` and OpenAI's retrieve of the one model served."""
    created = int(time.time())
    card = {
        "id": settings.model_name,
        "object": "model",
        "created": created,
        "owned_by": "moe-overlap",
        "max_model_len": engine.llm.max_len,  # vLLM's field
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (a Hub id holds a slash)
    async def model(model: str) -> dict:
        if model != settings.model_name:
            message = f"model {model!r} does not exist; this server serves {settings.model_name!r}"
            raise APIError(404, message, "model_not_found", "model")
        return card
