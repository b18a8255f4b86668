"""Refusals of a request body before any of it reaches the engine, each a 400 (404 for an unknown
model) that names the field: fields this server does not implement, invalid Unicode, stop lists
and fan-out beyond the server's limits, ``top_logprobs`` without ``logprobs``."""

from __future__ import annotations

from moe_overlap.server.guards import APIError
from moe_overlap.server.protocol import ChatRequest, SamplingFields, bad_unicode
from moe_overlap.server.settings import ServerSettings
from moe_overlap.server.unsupported import unsupported_field


def check_fields(body: SamplingFields, settings: ServerSettings, chat: bool) -> None:
    """Fields this server implements, the model's name, valid Unicode, a bounded stop list."""
    refused = unsupported_field(body.model_dump(), chat)
    if refused is not None:
        raise APIError(400, refused[1], "unsupported_parameter", refused[0])
    where = bad_unicode(body)
    if where:
        message = f"{where} holds invalid Unicode (a lone surrogate); send valid UTF-8 text"
        raise APIError(400, message, "invalid_value", where)
    _check_stop(body, settings)
    if body.stream_options is not None and not body.stream:  # OpenAI's and vLLM's rule
        message = "stream_options is only allowed with stream=true"
        raise APIError(400, message, "invalid_value", "stream_options")
    if isinstance(body, ChatRequest) and body.top_logprobs is not None and not body.logprobs:
        message = "top_logprobs needs logprobs=true (OpenAI's rule)"
        raise APIError(400, message, "invalid_value", "top_logprobs")
    if body.model is not None and body.model != settings.model_name:
        raise APIError(
            404,
            f"model {body.model!r} does not exist; this server serves {settings.model_name!r}",
            "model_not_found",
            "model",
        )


def check_fan_out(body: SamplingFields, prompts: int, settings: ServerSettings) -> None:
    """At most ``--max-prompts-per-request`` prompts and ``--max-choices-per-request`` choices
    (prompts x the larger of n and best_of): every choice is a request the engine queues."""
    most = settings.max_prompts_per_request
    if prompts > most:
        raise APIError(
            400,
            f"prompt holds {prompts} prompts; this server accepts at most {most} per request "
            "(--max-prompts-per-request)",
            "too_many_prompts",
            "prompt",
        )
    best_of = body.candidates() or 0
    per_prompt, field = (best_of, "best_of") if best_of > body.n else (body.n, "n")
    most = settings.max_choices_per_request
    if prompts * per_prompt > most:
        raise APIError(
            400,
            f"{prompts} prompt(s) x {field}={per_prompt} ask for {prompts * per_prompt} choices; "
            f"this server accepts at most {most} per request (--max-choices-per-request)",
            "too_many_choices",
            field,
        )


def _check_stop(body: SamplingFields, settings: ServerSettings) -> None:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    if len(stop) > settings.max_stop_sequences:
        raise APIError(
            400,
            f"stop has {len(stop)} strings; this server accepts at most "
            f"{settings.max_stop_sequences} (--max-stop-sequences)",
            "invalid_value",
            "stop",
        )
    longest = max(map(len, stop), default=0)
    if longest > settings.max_stop_chars:
        raise APIError(
            400,
            f"a stop string has {longest} characters; this server accepts at most "
            f"{settings.max_stop_chars} (--max-stop-chars)",
            "invalid_value",
            "stop",
        )
