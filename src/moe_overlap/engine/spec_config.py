"""Speculative decoding's settings: SGLang's ``--speculative-*`` flags and vLLM's
``--speculative-config`` JSON, read into one ``SpeculativeConfig`` (a conflict between them is
refused), and the models speculation refuses."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeVar

from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.engine.args import setting

ALGORITHMS = ("NGRAM", "EAGLE", "NEXTN")  # SGLang's names; NEXTN is EAGLE for MTP models
MTP_ALGORITHMS = ("EAGLE", "NEXTN")
# vLLM's "method" values, as SGLang's algorithm: "mtp" and the per-family MTP names of the
# families here, which vLLM itself reads as "mtp" (the model's config decides the layers)
_METHODS = {
    "ngram": "NGRAM",
    "mtp": "EAGLE",
    "deepseek_mtp": "EAGLE",
    "glm4_moe_mtp": "EAGLE",  # GLM-4.5's
    "qwen3_next_mtp": "EAGLE",  # what the Qwen3.5 model cards give
    "qwen3_5_mtp": "EAGLE",
    "mimo_v2_mtp": "EAGLE",  # MiMo-V2-Flash's
}
DEFAULT_NUM_DRAFT_TOKENS = 4  # rows per sequence in verify: the last token and 3 drafts
DEFAULT_MTP_STEPS = 3  # SGLang's DeepSeek default: 3 MTP steps, top-1, 4 draft tokens
DEFAULT_LOOKUP = (1, 12)  # SGLang's n-gram match window sizes
_VLLM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
_GROUP = "speculative decoding"
T = TypeVar("T")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What the scheduler drafts: ``num_drafts`` tokens per decoding sequence, n-gram ones
    found by matching its last ``lookup_min .. lookup_max`` tokens earlier in its prompt and
    output, or (EAGLE/NEXTN) the ones the ranks' MTP layers proposed after its last step."""

    algorithm: str
    num_drafts: int  # vLLM's num_speculative_tokens; SGLang's num_draft_tokens less one
    lookup_min: int
    lookup_max: int

    @property
    def is_mtp(self) -> bool:
        """The model's own MTP layers draft (SGLang's EAGLE/NEXTN, vLLM's mtp): one MTP step
        per draft on the ranks."""
        return self.algorithm in MTP_ALGORITHMS


@dataclass
class SpeculativeArgs:
    speculative_algorithm: str | None = setting(
        None,
        "speculative decoding's drafter (SGLang's flag): NGRAM drafts each decoding sequence's "
        "next tokens from an earlier match of its last tokens in its prompt and output (no "
        "weights); EAGLE (or its alias NEXTN) drafts them with the model's own MTP layers "
        "(DeepSeek-V3, GLM-4.5, MiMo-V2-Flash: num_nextn_predict_layers; Qwen3.5: "
        "mtp_num_hidden_layers). The "
        "target verifies them in one "
        "forward: greedy requests get plain decoding's tokens, sampled ones its distribution "
        "(rejection sampling); a structured output is served as without it",
        choices=ALGORITHMS,
        parse=str.upper,
        group=_GROUP,
    )
    speculative_num_draft_tokens: int | None = setting(
        None,
        "SGLang's count of rows per sequence in a verify forward: the last token plus the "
        f"drafts (None: {DEFAULT_NUM_DRAFT_TOKENS}, i.e. {DEFAULT_NUM_DRAFT_TOKENS - 1} drafts; "
        "vLLM's num_speculative_tokens is this less one)",
        parse=int,
        group=_GROUP,
    )
    speculative_num_steps: int | None = setting(
        None,
        "EAGLE/NEXTN: MTP steps per decoding step, i.e. drafts per sequence (None: "
        f"{DEFAULT_MTP_STEPS}, SGLang's DeepSeek default); a step past the model's MTP layers "
        "reuses the last one",
        parse=int,
        group=_GROUP,
    )
    speculative_eagle_topk: int = setting(
        1,
        "EAGLE/NEXTN: drafts kept per MTP step; only 1 (a chain of drafts) is built, tree "
        "drafts (> 1) are refused",
        group=_GROUP,
    )
    speculative_ngram_min_match_window_size: int = setting(
        DEFAULT_LOOKUP[0],
        "NGRAM: the shortest suffix matched (vLLM's prompt_lookup_min)",
        group=_GROUP,
    )
    speculative_ngram_max_match_window_size: int = setting(
        DEFAULT_LOOKUP[1],
        "NGRAM: the longest suffix matched, tried first (vLLM's prompt_lookup_max)",
        group=_GROUP,
    )
    speculative_config: str | dict[str, Any] | None = setting(
        None,
        'vLLM\'s JSON form, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 1, "prompt_lookup_max": 4}\' (in Python also a dict, as vLLM\'s '
        "LLM takes it); read into the flags above, and refused where it contradicts one given",
        metavar="JSON",
        group=_GROUP,
    )

    def speculative(self) -> SpeculativeConfig | None:
        """The one speculative config of the flags and the JSON (None: no speculation)."""
        algorithm, drafts = self.speculative_algorithm, self.speculative_num_draft_tokens
        algorithm = algorithm.upper() if isinstance(algorithm, str) else algorithm
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        given = _vllm_config(self.speculative_config)
        if given:
            algorithm = _agree("--speculative-algorithm", algorithm, _method(given))
            tokens = given.get("num_speculative_tokens", 0)
            _check_count("num_speculative_tokens", tokens, 1)
            drafts = _agree("--speculative-num-draft-tokens", drafts, int(tokens) + 1)
            low = _agree_default("prompt_lookup_min", low, DEFAULT_LOOKUP[0], given)
            high = _agree_default("prompt_lookup_max", high, DEFAULT_LOOKUP[1], given)
        if algorithm is None:
            steps = self.speculative_num_steps
            given_flag = (
                f"--speculative-num-draft-tokens={drafts}"
                if drafts is not None
                else (None if steps is None else f"--speculative-num-steps={steps}")
            )
            if given_flag is not None:
                raise ConfigError(
                    f"{given_flag} needs --speculative-algorithm NGRAM or EAGLE (or "
                    "--speculative-config)"
                )
            return None
        if algorithm not in ALGORITHMS:
            raise ConfigError(
                f"speculative algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}"
            )
        if algorithm in MTP_ALGORITHMS:
            drafts = self._mtp_draft_tokens(drafts)
        elif self.speculative_num_steps is not None:
            raise ConfigError(
                f"--speculative-num-steps={self.speculative_num_steps} counts MTP steps: it "
                "needs --speculative-algorithm EAGLE; NGRAM takes --speculative-num-draft-tokens"
            )
        drafts = DEFAULT_NUM_DRAFT_TOKENS if drafts is None else drafts
        _check_count("--speculative-num-draft-tokens", drafts, 2)
        _check_count("--speculative-ngram-min-match-window-size", low, 1)
        if not is_int(high) or high < low:
            raise ConfigError(
                f"--speculative-ngram-max-match-window-size={high!r} must be an integer >= "
                f"the min window size {low}"
            )
        return SpeculativeConfig(algorithm, drafts - 1, low, high)

    def _mtp_draft_tokens(self, drafts: int | None) -> int:
        """EAGLE's rows per verified sequence: its steps plus one (SGLang's rule for top-1)."""
        topk, steps = self.speculative_eagle_topk, self.speculative_num_steps
        if topk != 1:
            raise ConfigError(
                f"--speculative-eagle-topk={topk!r}: tree drafts (top-k > 1) are not built; "
                "use --speculative-eagle-topk 1 (a chain of drafts)"
            )
        if steps is None:
            steps = DEFAULT_MTP_STEPS if drafts is None else drafts - 1
        _check_count("--speculative-num-steps", steps, 1)
        if drafts is not None and drafts != steps + 1:
            raise ConfigError(
                f"--speculative-num-draft-tokens={drafts} must be --speculative-num-steps + 1 "
                f"= {steps + 1} with --speculative-eagle-topk 1; give one of them"
            )
        return steps + 1


def _method(given: dict) -> str | None:
    """vLLM's method as SGLang's algorithm name (None: not given)."""
    method = given.get("method")
    if method is None:
        return None
    if method not in _METHODS:
        raise ConfigError(
            f"--speculative-config method {method!r} is not one of {', '.join(_METHODS)}"
        )
    return _METHODS[method]


def _vllm_config(text: str | dict[str, Any] | None) -> dict:
    """The keys of ``--speculative-config``: JSON text, or a dict as vLLM's ``LLM`` takes."""
    if text is None:
        return {}
    try:
        given = dict(text) if isinstance(text, dict) else json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConfigError(f"--speculative-config={text!r} is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ConfigError(f"--speculative-config={text!r} must be a JSON object")
    unknown = sorted(set(given) - _VLLM_KEYS)
    if unknown:
        raise ConfigError(
            f"--speculative-config key {unknown[0]!r} is not supported; use "
            f"{', '.join(sorted(_VLLM_KEYS))}"
        )
    return given


def _agree(flag: str, value: T | None, from_json: T | None) -> T | None:
    """The JSON's value where the flag was not given; a different one given is refused."""
    if value is not None and from_json is not None and value != from_json:
        raise ConfigError(
            f"{flag}={value} contradicts --speculative-config's {from_json}; give one of them"
        )
    return from_json if from_json is not None else value


def _agree_default(key: str, value: int, default: int, given: dict) -> int:
    if key not in given:
        return value
    if value != default and value != given[key]:
        raise ConfigError(
            f"--speculative-config's {key}={given[key]} contradicts the flag's {value}; give one"
        )
    return given[key]


def _check_count(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")


def check_speculation(spec: SpeculativeConfig | None, cfg: ModelConfig, pdmux: bool) -> None:
    """Refuse what speculation is not exact on yet, each with the reason."""
    if spec is None:
        return
    mtp = spec.is_mtp
    refusals = [
        (mtp and not cfg.num_nextn_predict_layers, f"{cfg.model_type}'s config has no MTP "
         "layers (num_nextn_predict_layers is 0, or Qwen3.5's mtp_num_hidden_layers): use "
         "--speculative-algorithm NGRAM"),
        (mtp and cfg.is_hybrid and pdmux, "--enable-pdmux: Qwen3.5's MTP drafts beside "
         "prefill waves are not checked; drop one or use --speculative-algorithm NGRAM"),
    ]  # fmt: skip
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"speculative decoding ({spec.algorithm}) is refused: {why}")


def mtp_steps(spec: SpeculativeConfig | None) -> int:
    """The MTP steps each rank drafts after a step (0: the ranks build no MTP layers)."""
    return spec.num_drafts if spec is not None and spec.is_mtp else 0
