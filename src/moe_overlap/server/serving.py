"""The path every generating route takes: encode, check, queue each choice on the engine loop
(off the event loop), then stream the deltas or wait for every answer, in the shape a
``Formatter`` writes (OpenAI's, or SGLang's native one)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from moe_overlap.core.errors import NOTHING_ALLOWED
from moe_overlap.engine.candidates import candidates, chosen
from moe_overlap.engine.loop import SHUTTING_DOWN, EngineDead, EngineLoop
from moe_overlap.engine.request import SamplingParams
from moe_overlap.server.guards import APIError, ServerSettings, error_body
from moe_overlap.server.logprobs import TokenText
from moe_overlap.server.observability import RequestMetrics, ServerMetrics
from moe_overlap.server.protocol import SamplingFields
from moe_overlap.server.responses import DONE, Choice, Formatter, sse
from moe_overlap.server.submission import Submission, choice_name

MakeFormatter = Callable[..., Formatter]  # Formatter, or a subclass writing another shape


def encode_prompt(
    engine: EngineLoop, prompt: str | list[int], where: str, special: bool = True
) -> list[int]:
    """A text prompt's token ids, with the tokenizer's special tokens (a BOS) where
    ``special``, as vLLM's completions (``add_special_tokens``, default true) and SGLang's
    ``/generate`` encode it; token ids are taken as given."""
    if not isinstance(prompt, str):
        return prompt
    if engine.llm.tokenizer is None:
        raise APIError(400, f"{where} is text, but the model has no tokenizer; send token ids")
    return engine.llm.tokenizer.encode(prompt, add_special_tokens=special)


def max_new_tokens(
    engine: EngineLoop,
    settings: ServerSettings,
    ids: list[int],
    limit: int | None,
    field: str = "prompt",
) -> int:
    """The tokens a prompt may generate; a 400 naming ``field`` (chat's ``messages``, as
    OpenAI's context_length_exceeded does) where it leaves no room for them."""
    context = engine.llm.max_len
    most = settings.max_prompt_tokens or context - 1
    if len(ids) > most:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens, more than the {most} this server accepts",
            "prompt_too_long",
            field,
        )
    if limit is not None and len(ids) + limit > context:
        raise APIError(
            400,
            f"this model's maximum context length is {context} tokens, but {len(ids)} prompt "
            f"tokens and max_tokens={limit} were asked for",
            "context_length_exceeded",
            field,
        )
    return limit if limit is not None else context - len(ids)


async def serve(
    engine: EngineLoop,
    settings: ServerSettings,
    metrics: ServerMetrics,
    body: SamplingFields,
    encode: Callable[[], list[list[int]]],
    texts: list[str | list[int]] | None,
    limit: int | None,
    chat: bool,
    request: Request,
    make: MakeFormatter = Formatter,
) -> dict | list[dict] | StreamingResponse:
    """Queue every choice (a bad one aborts those queued before it), then stream the deltas
    or wait for every answer."""
    if engine.error:
        raise EngineDead(engine.error)
    trouble = engine.health()  # a stopped rank: no step can finish, so refuse at once
    if trouble:
        raise APIError(503, trouble, "rank_unhealthy")
    sub = Submission(engine)
    call = (engine, settings, body, encode, texts, limit, chat, sub, make)
    try:  # off the event loop: tokenizing and checking hundreds of long prompts takes a while
        params, fmt = await asyncio.to_thread(_queue, *call)
    except BaseException:
        sub.close()
        raise
    k = fmt.per_prompt
    timed = metrics.request(fmt.id)
    if body.stream:
        options = body.stream_options
        usage = bool(options and options.include_usage)
        fmt.continuous_usage = usage and bool(options and options.continuous_usage_stats)
        events = _events(sub, fmt, len(params) * k, usage, request, timed)
        return StreamingResponse(events, media_type="text/event-stream")
    choices = fmt.choices()
    try:
        async for index, delta in sub.deltas(request.is_disconnected):
            timed.delta(index, delta)
            if delta.error and delta.error == SHUTTING_DOWN:
                raise APIError(503, f"{SHUTTING_DOWN}; retry elsewhere", "shutting_down")
            if delta.error:
                raise EngineDead(delta.error)
            if delta.failed:
                raise request_failed(
                    f"{choice_name(index, k)} failed: {delta.failed}", delta.failed
                )
            fmt.add(choices[index], index, delta)
    finally:
        sub.close()
        timed.close(len(choices))
    return fmt.whole(_best(params, choices, k))


def _queue(
    engine: EngineLoop,
    settings: ServerSettings,
    body: SamplingFields,
    encode: Callable[[], list[list[int]]],
    texts: list[str | list[int]] | None,
    limit: int | None,
    chat: bool,
    sub: Submission,
    make: MakeFormatter,
) -> tuple[list[SamplingParams], Formatter]:
    """On a worker thread: the prompts' tokens, each prompt's parameters (checked against the
    vocabulary), every choice queued on ``sub``, and the call's formatter."""
    prompts = encode()
    field = "messages" if chat else "prompt"
    params = [body.params(max_new_tokens(engine, settings, ids, limit, field)) for ids in prompts]
    params[0].check_vocabulary(engine.llm.config.vocab_size)  # the prompts share these ids
    asked = [candidates(sp) for sp in params]  # n or best_of requests per prompt
    k = len(asked[0])
    if body.stream and k > body.n:
        message = f"best_of={k} > n={body.n} cannot be streamed: the best are known at the end"
        raise APIError(400, message, "invalid_value", "best_of")
    for i, (ids, group) in enumerate(zip(prompts, asked, strict=True)):
        for j, sp in enumerate(group):
            sub.add(i * k + j, ids, sp, where=f"prompt {i}")
        time.sleep(0)  # hand the GIL to the event loop between prompts
    return params, _formatter(engine, settings, body, prompts, texts, chat, k, make)


def _best(params: list[SamplingParams], choices: list[Choice], k: int) -> list[Choice]:
    """Each prompt's ``n`` choices out of its ``k`` candidates (by total log-probability)."""
    picked = []
    for i, sp in enumerate(params):
        group = choices[i * k : (i + 1) * k]
        picked += [group[j] for j in chosen(sp, [c.cumulative for c in group])]
    return picked


async def _events(
    sub: Submission, fmt: Formatter, n: int, usage: bool, request: Request, timed: RequestMetrics
) -> AsyncIterator[str]:
    """The stream: deltas as they come, then usage if asked, then [DONE]; after an error
    event, [DONE] alone (vLLM's). A client that goes away cancels this generator, and
    ``close`` aborts what it had asked for."""
    choices = fmt.choices()
    try:
        if fmt.chat:
            for i in range(n):
                yield fmt.chunk(i, None)
        async for index, delta in sub.deltas(request.is_disconnected):
            timed.delta(index, delta)
            if delta.error:
                yield sse(stopped_body(delta.error))
                usage = False
                break
            if delta.failed:
                message = f"{choice_name(index, fmt.per_prompt)} failed: {delta.failed}"
                failed = request_failed(message, delta.failed)
                yield sse(error_body(failed.status, failed.message, failed.code, failed.param))
                usage = False
                break
            fmt.add(choices[index], index, delta)
            yield fmt.chunk(index, delta, choices[index])
        if usage:
            yield fmt.usage_chunk(choices)
        yield DONE
    finally:
        sub.close()
        timed.close(n)


def _formatter(
    engine: EngineLoop,
    settings: ServerSettings,
    body: SamplingFields,
    prompts: list[list[int]],
    texts: list[str | list[int]] | None,
    chat: bool,
    per_prompt: int,
    make: MakeFormatter,
) -> Formatter:
    """The call's formatter: with ``echo`` each choice starts with its prompt's text (as sent,
    or decoded from ids), and its log-probabilities when asked."""
    tok = engine.llm.tokenizer
    echo = None
    if texts is not None and getattr(body, "echo", False):
        decode = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: "")
        shown = [t if isinstance(t, str) else decode(t) for t in texts]
        echo = [e for e in zip(prompts, shown, strict=True) for _ in range(per_prompt)]
    # echo's prompt log-probabilities come with the output's, where logprobs asks for them
    asked = body.token_logprobs() is not None
    lengths = [len(ids) for ids in prompts]
    name = settings.model_name
    fmt = make(chat, name, lengths, echo, asked, TokenText(tok), per_prompt)
    fmt.answer = body.chat_answer()
    fmt.prompt_ids = prompts if getattr(body, "return_token_ids", False) else None
    return fmt


def stopped_body(why: str) -> dict:
    if why == SHUTTING_DOWN:
        return error_body(503, f"{SHUTTING_DOWN}; retry elsewhere", "shutting_down")
    return error_body(503, f"the engine stopped: {why}", "engine_dead")


def request_failed(message: str, why: str) -> APIError:
    """A request that failed while it ran: the server's fault (500), but where its own
    settings left it no token (``NOTHING_ALLOWED``), the client's (400)."""
    if why == NOTHING_ALLOWED:
        return APIError(400, message, "invalid_value", "min_tokens")
    return APIError(500, message, "request_failed")
