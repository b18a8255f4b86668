"""SGLang's native routes and vLLM's token routes, beside the OpenAI ones.

``/generate`` (SGLang's ``GenerateReqInput``: ``text`` or ``input_ids``, ``sampling_params``,
``stream``, ``return_logprob``) runs the same path as ``/v1/completions``: its body becomes a
``CompletionRequest``, so every check and limit holds alike, and only the response's shape is
SGLang's (``text``, ``output_ids``, ``meta_info``; streamed text is cumulative, as SGLang's
default). ``/get_model_info``, ``/get_server_info``, ``/flush_cache`` and ``/health_generate``
are SGLang's; ``/tokenize`` and ``/detokenize`` are vLLM's. A field either is honoured or gets a
400 naming it (``extra="forbid"``): nothing is silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from moe_overlap.engine.request import DEFAULT_TEMPERATURE
from moe_overlap.server.guards import APIError
from moe_overlap.server.protocol import ChatMessage, ChatRequest, CompletionRequest
from moe_overlap.server.responses import Choice, Formatter, sse
from moe_overlap.server.tools import ToolSpec

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default


class NativeSampling(BaseModel):
    """SGLang's ``sampling_params``: the ones this engine honours."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int = Field(default=SGLANG_MAX_NEW_TOKENS, ge=1)
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = Field(default=None, ge=0)
    json_schema: str | None = None  # structured outputs: a JSON schema as text
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: NativeSampling = Field(default_factory=NativeSampling)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: Literal[-1] = -1  # the prompt's log-probabilities are not returned
    lora_path: None = None  # no adapters: only null is accepted
    return_routed_experts: Literal[False] = False  # sent by SGLang's bench_serving; not kept

    def batched(self) -> bool:
        prompt = self.text if self.text is not None else self.input_ids
        return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)

    def completion(self) -> CompletionRequest:
        """The same request as ``/v1/completions`` takes it (its errors name the fields inside
        ``sampling_params``)."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "send exactly one of text and input_ids", "invalid_value", "text")
        sp = self.sampling_params
        return NativeCompletion(
            prompt=self.text if self.text is not None else self.input_ids,
            max_tokens=sp.max_new_tokens,
            min_tokens=sp.min_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            stop=sp.stop,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            n=sp.n,
            frequency_penalty=sp.frequency_penalty,
            presence_penalty=sp.presence_penalty,
            repetition_penalty=sp.repetition_penalty,
            logit_bias=sp.logit_bias,
            seed=sp.sampling_seed,
            json_schema=sp.json_schema,
            regex=sp.regex,
            ebnf=sp.ebnf,
            logprobs=0 if self.return_logprob else None,
            stream=self.stream,
        )


class NativeCompletion(CompletionRequest):
    def fields_at(self) -> str:
        return "sampling_params."


class NativeFormatter(Formatter):
    """SGLang's response shapes: per choice ``text``, ``output_ids`` and ``meta_info``; one
    object for one prompt and one choice, else a list; streamed chunks carry the whole text
    so far."""

    def __init__(self, *args, batched: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.batched = batched

    def _meta(self, index: int, c: Choice) -> dict:
        meta: dict = {
            "id": f"{self.id}-{index}",
            "finish_reason": {"type": c.finish_reason} if c.finish_reason else None,
            "prompt_tokens": self.prompt_tokens[index // self.per_prompt],
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens,  # prompt tokens found in the prefix cache
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [
                [lp.logprob if lp else None, token, None] for token, lp in c.entries
            ]
        return meta

    def _item(self, index: int, c: Choice) -> dict:
        return {"text": c.text, "output_ids": c.token_ids, "meta_info": self._meta(index, c)}

    def whole(self, choices: list[Choice]) -> dict | list[dict]:  # type: ignore[override]
        items = [self._item(i, c) for i, c in enumerate(choices)]
        return items if self.batched or len(items) > 1 else items[0]

    def chunk(self, index: int, delta, choice: Choice | None = None) -> str:
        assert choice is not None, "a native stream has no opening role chunk"
        return sse({**self._item(index, choice), "index": index})


_CHAT_INPUTS = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a prompt, or chat messages through the model's template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    return_token_strs: bool = False  # vLLM's: each id's token string too, in token_strs
    # with messages, the chat route's template inputs, so the count is the one chat sees
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[ToolSpec] | None = None

    def chat(self) -> ChatRequest:
        """The messages as a chat request carries them (its template inputs)."""
        return ChatRequest.model_construct(**{f: getattr(self, f) for f in _CHAT_INPUTS})


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[StrictInt]
