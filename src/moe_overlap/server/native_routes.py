"""The routes of ``native.py``'s bodies: SGLang's /generate, /get_model_info, /get_server_info,
/flush_cache and /health_generate, and vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import dataclasses
import functools

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from moe_overlap.engine.loop import EngineDead, EngineLoop
from moe_overlap.server.chat_prompt import chat_prompt_ids
from moe_overlap.server.checks import check_fan_out, check_fields
from moe_overlap.server.guards import APIError, ServerSettings, error_response
from moe_overlap.server.native import (
    DetokenizeRequest,
    GenerateRequest,
    NativeFormatter,
    TokenizeRequest,
)
from moe_overlap.server.observability import ServerMetrics, package_version
from moe_overlap.server.protocol import CompletionRequest
from moe_overlap.server.serving import encode_prompt, serve


def install_native(
    app: FastAPI, engine: EngineLoop, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    _install_generate(app, engine, settings, metrics)
    _install_info(app, engine, settings, metrics)
    _install_tokens(app, engine, settings)
    _install_expert_record(app, engine, metrics)


def _install_expert_record(app: FastAPI, engine: EngineLoop, metrics: ServerMetrics) -> None:
    """SGLang's expert-distribution recorder: start, stop, and dump what the ranks counted
    (which also sets /metrics' per-rank expert load and balancedness)."""
    llm = engine.llm

    async def on_engine(fn):
        try:
            return await asyncio.to_thread(engine.call, fn)
        except EngineDead as error:
            raise APIError(503, f"the engine is down: {error}", "unavailable") from None

    @app.post("/start_expert_distribution_record")
    async def start_record() -> JSONResponse:
        await on_engine(llm.start_expert_distribution_record)
        return JSONResponse({"message": "recording the expert distribution"})

    @app.post("/stop_expert_distribution_record")
    async def stop_record() -> JSONResponse:
        await on_engine(llm.stop_expert_distribution_record)
        return JSONResponse({"message": "stopped recording the expert distribution"})

    @app.post("/dump_expert_distribution_record")
    async def dump_record() -> JSONResponse:
        distribution = await on_engine(llm.expert_distribution)
        metrics.expert_load(distribution)
        return JSONResponse(distribution.to_json())


def _install_generate(
    app: FastAPI, engine: EngineLoop, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        completion = body.completion()
        check_fields(completion, settings, chat=False)
        texts = completion.prompts()
        check_fan_out(completion, len(texts), settings)

        def encode() -> list[list[int]]:
            return [encode_prompt(engine, p, f"prompt {i}") for i, p in enumerate(texts)]

        batched = body.batched()
        call = (completion, encode, None, completion.max_tokens, False, request)
        make = functools.partial(NativeFormatter, batched=batched)
        return await serve(engine, settings, metrics, *call, make)


def _install_info(
    app: FastAPI, engine: EngineLoop, settings: ServerSettings, metrics: ServerMetrics
) -> None:
    llm = engine.llm

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {
            "model_path": llm.spec.model_path,
            "tokenizer_path": llm.spec.model_path if llm.tokenizer is not None else None,
            "is_generation": True,
            "served_model_name": settings.model_name,
            "max_context_length": llm.max_len,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict:
        server = dataclasses.asdict(settings)
        server.pop("api_key", None)  # a secret, not a setting to show
        engine_args = dataclasses.asdict(llm.args)
        stats = engine.stats()
        rate = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
        # SGLang's cache_hit_rate: the share of prompt tokens found in the prefix cache
        return {
            **engine_args,
            **server,
            "version": package_version(),
            **stats,
            "cache_hit_rate": rate,
        }

    async def flush_cache() -> JSONResponse:
        engine.flush_cache()  # done on the engine's thread before its next step
        message = "Cache flushed: cached KV pages are freed before the next step"
        return JSONResponse({"message": message})

    app.get("/flush_cache", operation_id="flush_cache_get")(flush_cache)  # SGLang takes both
    app.post("/flush_cache", operation_id="flush_cache_post")(flush_cache)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """One greedy token end to end: every rank stepped, not just alive."""
        probe = CompletionRequest(prompt=[[0]], max_tokens=1, temperature=0.0)
        try:
            await serve(engine, settings, metrics, probe, lambda: [[0]], None, 1, False, request)
        except (APIError, EngineDead) as error:
            return error_response(503, f"generation failed: {error}", "unhealthy")
        return JSONResponse({"status": "ok"})


def _install_tokens(app: FastAPI, engine: EngineLoop, settings: ServerSettings) -> None:
    llm = engine.llm

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tok = _tokenizer(engine, body.model, settings)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt and messages", "invalid_value")
        if body.messages is None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=special)
        else:
            ids = chat_prompt_ids(tok, body.chat())
            if body.add_special_tokens:  # vLLM's default for messages is false
                ids = tok.build_inputs_with_special_tokens(ids)
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": llm.max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        tok = _tokenizer(engine, body.model, settings)
        vocab = llm.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            message = f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab})"
            raise APIError(400, message, "invalid_value", "tokens")
        return {"prompt": tok.decode(body.tokens)}


def _tokenizer(engine: EngineLoop, model: str | None, settings: ServerSettings):
    if model is not None and model != settings.model_name:
        message = f"model {model!r} does not exist; this server serves {settings.model_name!r}"
        raise APIError(404, message, "model_not_found", "model")
    if engine.llm.tokenizer is None:
        raise APIError(400, "the model has no tokenizer (tokenizer.json)", "no_tokenizer")
    return engine.llm.tokenizer
