"""Sampling parameters, requests and their outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from moe_overlap.core.step import Penalties, SampleSpec, TokenLogprobs
from moe_overlap.engine.detokenize import TextStream
from moe_overlap.engine.errors import (
    InvalidRequestError,
    check_integer,
    check_number,
    listed,
)
from moe_overlap.engine.kv_pages import CachedPage
from moe_overlap.engine.structured import StructuredOutputs, TokenConstraint

SAMPLING_EPS = 1e-5  # temperatures below are greedy (vLLM's rule): dividing would overflow
DEFAULT_TEMPERATURE = 1.0  # vLLM's and OpenAI's, for Python, the command line and HTTP alike
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
# repetition_penalty's bounds: fp32 logits divided or multiplied by a value outside overflow to
# inf (1e-45 makes NaN probabilities) or vanish, and vLLM's (0, inf) admits those
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


@dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = DEFAULT_TEMPERATURE  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM spells it) means no top-k cut
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the likeliest's probability
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] | str | None = None  # strings that end the output (needs a tokenizer)
    stop_token_ids: list[int] | None = None  # ids that end the output (in its ids, not its text)
    # log-probabilities of each generated token and of the ``logprobs`` likeliest (0-20)
    logprobs: int | None = None
    # log-probabilities of each prompt token after the first given the ones before it (and of
    # the ``prompt_logprobs`` likeliest); with max_new_tokens=0 a request only scores its prompt
    prompt_logprobs: int | None = None
    # vLLM's penalties and biases, applied on the ranks before temperature (never to logprobs)
    presence_penalty: float = 0.0  # [-2, 2], once per token already generated
    frequency_penalty: float = 0.0  # [-2, 2], per time a token was generated
    repetition_penalty: float = 1.0  # > 0; > 1 discourages tokens of the prompt and output
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100]
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end the output sooner
    n: int = 1  # outputs per prompt
    best_of: int | None = None  # candidates per prompt, the n likeliest returned (>= n)
    # the output follows a JSON schema, regex, choice or grammar (engine/grammar.py)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self.stop = listed("stop", self.stop, str)
        bad = [s for s in self.stop if not isinstance(s, str) or not s]
        if bad:
            message = f"stop={bad[0]!r}: stop strings must be non-empty strings"
            raise InvalidRequestError(message, "stop")
        self.stop_token_ids = listed("stop_token_ids", self.stop_token_ids, int)
        for t in self.stop_token_ids:
            check_integer("stop_token_ids", t, minimum=0, note=" (a token id)")
        scoring = " (0 needs prompt_logprobs: scoring a prompt)"
        minimum = 0 if self.prompt_logprobs is not None else 1
        check_integer("max_new_tokens", self.max_new_tokens, minimum=minimum, note=scoring)
        check_integer("top_k", self.top_k, minimum=-1, note=" (0 or vLLM's -1 disables it)")
        self.top_k = max(self.top_k, 0)
        if self.seed is not None:
            check_integer("seed", self.seed, minimum=0)
        check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p={self.top_p} must be in (0, 1]")
        check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check_integer(name, value, minimum=0, note=" (alternatives per token)")
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(f"{name}={value} must be at most {MAX_LOGPROBS}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos={self.ignore_eos!r} must be True or False")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise InvalidRequestError(f"structured_outputs={so!r:.40} must be StructuredOutputs")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check_number(name, value)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name}={value} must be in [-2, 2]", name)
        check_number("repetition_penalty", self.repetition_penalty)
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise InvalidRequestError(
                f"repetition_penalty={self.repetition_penalty} must be > 0 and in "
                f"[{low:g}, {high:g}] (1 disables it)",
                "repetition_penalty",
            )
        check_integer("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens={self.min_tokens} must be at most max_new_tokens={self.max_new_tokens}",
                "min_tokens",
            )
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise InvalidRequestError(f"logit_bias={bias!r:.40} must map token ids to biases")
        for token, value in bias.items():
            check_integer("logit_bias", token, minimum=0, note=" (a token id as key)")
            check_number(f"logit_bias[{token}]", value)
        self.logit_bias = {t: min(100.0, max(-100.0, float(v))) for t, v in bias.items()}

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuses a ``stop_token_ids`` entry or ``logit_bias`` key outside [0, vocab_size)."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", self.logit_bias or {}),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size})",
                    name,
                )

    @property
    def penalised(self) -> bool:
        """Any adjustment of the logits asked for (else the rank samples them as they are)."""
        adjusted = (self.presence_penalty, self.frequency_penalty, self.logit_bias, self.min_tokens)
        return any(adjusted) or self.repetition_penalty != 1.0


@dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    # "eos", "stop" (a stop string or stop token id), "length" (max_new_tokens) or
    # "context" (the model's context is full) or "error" (this request alone failed: ``error``)
    finish_reason: str
    prompt_logits: torch.Tensor | None = None  # float32 [prompt_len, vocab]
    text: str | None = None  # the output as text (None when the model has no tokenizer)
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked
    cumulative_logprob: float | None = None  # their sum
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, first None
    # with n > 1: the prompt's n outputs (this one first); its other fields are outputs[0]'s
    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass(eq=False)  # a request is itself: compared by identity, not field by field
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    return_logits: bool = False
    rank: int = -1  # the attention-DP rank whose KV cache holds it
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: int = 0  # KV pages the scheduler counts as this request's
    cached: list[CachedPage] = field(default_factory=list)  # its first pages, prefix-cached
    cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    preemptions: int = 0  # times its cache was dropped to make room (then recomputed)
    output_ids: list[int] = field(default_factory=list)
    logit_chunks: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    seed: int = 0  # with the index of each token, seeds its draw on the rank
    text: TextStream | None = None  # with a tokenizer: the output's text and stop strings
    error: str | None = None  # why this request alone failed (finish_reason "error")
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    told: bool = False  # a listener has heard from it (the first delta carries prompt_logprobs)
    eos_token_id: int | None = None  # masked until min_tokens are generated
    constraint: TokenConstraint | None = None  # structured outputs: follows every token taken
    mtp_drafts: list[int] = field(default_factory=list)  # the ranks' MTP drafts after its last
    prompt_len: int = field(init=False, default=0)  # read many times a step: not recounted

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)

    @property
    def in_prefill(self) -> bool:
        """Tokens to feed before the draw: the prompt's, or after a preemption all but one."""
        n = self.prompt_len
        return self.num_computed < max(n, n + len(self.output_ids) - 1)

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def total_len(self) -> int:
        return self.prompt_len + len(self.output_ids)

    def token_at(self, i: int) -> int:
        """Token ``i`` of its prompt followed by its output."""
        return self.prompt_ids[i] if i < self.prompt_len else self.output_ids[i - self.prompt_len]

    def next_input(self, budget: int) -> list[int]:
        """The tokens to feed next: a prompt chunk of at most ``budget``, or the last output."""
        if self.in_prompt:  # a chunk never runs past the prompt: its logits are the prompt's
            return self.prompt_ids[self.num_computed : self.num_computed + budget]
        if self.in_prefill:  # recomputing the outputs after a preemption
            start = self.num_computed - self.prompt_len
            return self.output_ids[start : min(start + budget, len(self.output_ids) - 1)]
        return [self.output_ids[-1]]

    @property
    def keeps_logits(self) -> bool:
        """This step's logit rows go back to the caller (``return_logits``, while prefilling)."""
        return self.return_logits and self.in_prompt

    @property
    def needs_all_logits(self) -> bool:
        """Its rank computes every prompt position's logits (to return or to score them)."""
        return self.keeps_logits or (self.in_prompt and self.params.prompt_logprobs is not None)

    def sample_spec(self, fed: int, drafts: Sequence[int] = (), masks: bool = True) -> SampleSpec:
        """What its rank does with the logits of the ``fed`` tokens this step feeds (the last
        ones ``drafts`` to verify): keep them, score the prompt tokens they predict, and after
        the prompt's last chunk draw a token; ``masks`` False leaves a structured output's
        bitmasks to the caller (``Step.samples`` fills a step's together)."""
        p, start = self.params, self.num_computed
        scored = p.prompt_logprobs is not None and self.in_prompt
        draw = start + fed >= self.total_len and p.max_new_tokens > 0  # a new token next
        return SampleSpec(
            p.temperature,
            p.top_p,
            p.top_k,
            self.seed,
            len(self.output_ids),
            p.logprobs,
            draw=draw,
            keep_logits=self.keeps_logits,
            prompt_logprobs=p.prompt_logprobs,
            next_ids=tuple(self.prompt_ids[start + 1 : start + fed + 1]) if scored else (),
            penalties=self._penalties() if p.penalised else None,
            allowed=self.constraint.allowed(drafts) if self.constraint and draw and masks else None,
            drafts=tuple(drafts),
            following=None if draw or start + fed >= self.total_len else self.token_at(start + fed),
            min_p=p.min_p,
        )

    def _penalties(self) -> Penalties:
        """The adjustments with the history they need (sent each step: the rank keeps none)."""
        p = self.params
        stops = list(p.stop_token_ids or [])
        if self.eos_token_id is not None:
            stops.append(self.eos_token_id)
        return Penalties(
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
            tuple((p.logit_bias or {}).items()),
            p.min_tokens,
            tuple(stops),
            tuple(self.prompt_ids) if p.repetition_penalty != 1.0 else (),
            tuple(self.output_ids),
        )

    def preempt(self) -> None:
        """Drop its cache (vLLM's preemption by recompute): prompt and outputs are fed again."""
        self.rank, self.slot, self.num_computed, self.pages = -1, -1, 0, 0
        self.logit_chunks, self.prompt_logprobs = [], [None]
        self.preemptions += 1

    def take(self, token: int, logprobs: TokenLogprobs | None) -> None:
        """A token its rank sampled (with its log-probabilities when asked)."""
        if self.constraint is not None:  # before the token counts: a refused one is not kept
            self.constraint.accept(token)
        self.output_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def to_output(self) -> RequestOutput:
        logits = torch.cat(self.logit_chunks) if self.return_logits else None
        asked = self.params.logprobs is not None
        return RequestOutput(
            self.request_id,
            self.prompt_ids,
            list(self.output_ids),
            self.finish_reason or "length",
            logits,
            self.text.text if self.text is not None else None,
            self.error,
            list(self.logprobs) if asked else None,
            sum(lp.logprob for lp in self.logprobs) if asked else None,
            list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None,
        )
