"""The OpenAI request bodies the server accepts and the SamplingParams they become. Fields it
does not declare are kept (``extra="allow"``) for ``unsupported.py`` to refuse the OpenAI ones
it cannot honour; the rest are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

import contextlib
import json
import types
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, model_validator

from moe_overlap.engine.request import (
    DEFAULT_TEMPERATURE,
    MAX_LOGPROBS,
    InvalidRequestError,
    SamplingParams,
)
from moe_overlap.server.chat_answer import ChatAnswer
from moe_overlap.server.structured import FIELDS, structured_outputs
from moe_overlap.server.tools import ToolCalling, ToolChoice, ToolSpec, tool_calling

SEED_MAX = 2**64 - 1  # torch.Generator takes 64-bit seeds
MAX_TOKEN_ID_DIGITS = 10  # a logit_bias key longer is no vocabulary's token id

# OpenAI's names for why a choice ended
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class NullIsDefault(BaseModel):
    """A body where ``null`` is a field's default, as OpenAI's API and vLLM read it (OpenAI's
    clients send ``temperature=None`` as null); a field that takes null itself keeps it."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or types.NoneType in get_args(fields[k].annotation)
        }


class StreamOptions(NullIsDefault):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class SamplingFields(NullIsDefault):
    # strict: true is not a number and "yes" not a boolean (an int is still a float)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extension; 0 and -1 disable it
    min_p: float = Field(default=0.0, ge=0, le=1)  # vLLM's and SGLang's extension; 0 disables it
    seed: int | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None  # true is not 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # null is the default, as OpenAI's clients may send it
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token ids
    min_tokens: int | None = None  # vLLM's extension
    n: int = Field(default=1, ge=1)
    return_token_ids: bool = False  # vLLM's: the prompt's ids too (each choice has token_ids)
    # structured outputs, as OpenAI, vLLM and SGLang spell them (server/structured.py)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def token_logprobs(self) -> int | None:
        """Alternatives per generated token to return, or None (no log-probabilities)."""
        return None

    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to return (echo), or None."""
        return None

    def candidates(self) -> int | None:
        """``best_of``: completions only."""
        return None

    def fields_at(self) -> str:
        """Where the sampling fields sit in the body, for errors that name one."""
        return ""

    def tool_calling(self) -> ToolCalling | None:
        """The tool calls the output is held to (chat only), or None."""
        return None

    def chat_answer(self) -> ChatAnswer | None:
        """How a chat answer's reasoning and tool calls are read out (chat only), or None."""
        return None

    def params(self, max_new_tokens: int) -> SamplingParams:
        constraint = structured_outputs({f: getattr(self, f) for f in FIELDS}, self.fields_at())
        calling = self.tool_calling()
        if calling is not None:
            if constraint is not None:
                message = f"tool_choice and {constraint.field} each constrain the output: send one"
                raise InvalidRequestError(message, "tool_choice")
            constraint = calling.constraint()
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            logprobs=self.token_logprobs(),
            prompt_logprobs=self.prompt_logprobs(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_token_keys(self.logit_bias),
            min_tokens=self.min_tokens or 0,
            n=self.n,
            best_of=self.candidates(),
            structured_outputs=constraint,
        )


def _token_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias``'s string keys as token ids; a key that is not one is refused by name."""
    if bias is None:
        return None
    bad = [k for k in bias if not _is_token_id(k)]
    if bad:
        message = f"logit_bias key {bad[0]!r:.40} is not a token id"
        note = f" (at most {MAX_TOKEN_ID_DIGITS} ASCII digits)"
        raise InvalidRequestError(message + note, "logit_bias")
    return {int(k): v for k, v in bias.items()}


def _is_token_id(key: str) -> bool:
    # str.isdigit alone takes "²" and "٣", which int() refuses or reads as another id
    return 0 < len(key) <= MAX_TOKEN_ID_DIGITS and key.isascii() and key.isdigit()


class CompletionRequest(SamplingFields):
    # one prompt (text or token ids) or a batch of them
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # OpenAI's default for completions; 0 with echo scores the prompt (lm-eval's loglikelihood)
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS

    def candidates(self) -> int | None:
        return self.best_of

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        if not self.echo:
            return None
        if self.logprobs is None and self.max_tokens == 0:
            return 0  # the engine scores a prompt only when it computes these
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt:
            return [prompt] if isinstance(prompt, str) else [[]]
        if all(isinstance(t, int) for t in prompt):
            return [[t for t in prompt if isinstance(t, int)]]
        return [p for p in prompt if isinstance(p, str | list)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str  # unsupported.py refuses all but "text"
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        message: dict = {"role": self.role, "content": self.text()}
        extra = self.model_extra or {}
        for key in ("name", "tool_call_id"):
            if isinstance(extra.get(key), str):
                message[key] = extra[key]
        calls = extra.get("tool_calls")
        if isinstance(calls, list) and calls:
            message["tool_calls"] = [_call_for_template(c) for c in calls]
        return message


def _call_for_template(call: object) -> object:
    """An earlier call with its ``arguments`` (JSON text on the wire) as an object."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    with contextlib.suppress(TypeError, ValueError):  # not JSON: the text as sent
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "function": function}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True  # False: tool_choice='required' makes one call
    # vLLM's chat template controls (server/chat_prompt.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    include_reasoning: bool = True  # vLLM's: False drops the reasoning from the answer
    separate_reasoning: bool = True  # SGLang's: False leaves it in the content
    # the server's --tool-call-parser (for tool_choice 'auto') and --reasoning-parser
    _tool_parser: str | None = PrivateAttr(default=None)
    _reasoning_parser: str | None = PrivateAttr(default=None)

    def use_parsers(self, tool: str | None, reasoning: str | None) -> None:
        self._tool_parser, self._reasoning_parser = tool, reasoning

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_answer(self) -> ChatAnswer | None:
        tools = self.tool_calling()
        reasoning = self._reasoning_parser if self.separate_reasoning else None
        if tools is None and reasoning is None:
            return None
        return ChatAnswer(tools, reasoning, self.include_reasoning)

    def tool_calling(self) -> ToolCalling | None:
        choice, parallel = self.tool_choice, self.parallel_tool_calls
        return tool_calling(self.tools, choice, parallel, self._tool_parser)

    def conversation(self) -> list[dict]:
        """The messages as a chat template reads them: each text, and an assistant's earlier
        calls (arguments as objects, as Hugging Face's templates expect) or a tool's answer
        with the call it answers."""
        return [m.for_template() for m in self.messages]


def bad_unicode(value: object, where: str = "") -> str | None:
    """The path of the first string holding a lone surrogate (JSON allows ``"\\ud800"``; no
    tokenizer can encode it), or None."""
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = bad_unicode(item, f"{where}.{key}" if where else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = bad_unicode(item, f"{where}.{i}")
            if found:
                return found
    return None
