"""Model and parallel configuration, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "deepseek_v2")
_ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}


class ConfigError(ValueError):
    """A configuration value is missing, malformed or impossible."""


@dataclass
class ModelConfig:
    """Everything the model code needs; one dataclass for both families."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # dense MLP width (DeepSeek's first layers)
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    # Qwen3-MoE: layers listed here use a dense MLP instead of experts.
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1
    # DeepSeek-V2/V3.
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring_func: str = "softmax"  # "sigmoid" for DeepSeek-V3
    topk_method: str = "greedy"  # "noaux_tc" for DeepSeek-V3, "group_limited_greedy" for V2
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_deepseek(self) -> bool:
        return self.model_type.startswith("deepseek")

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.is_deepseek:
            return layer_id >= self.first_k_dense_replace
        step = max(self.decoder_sparse_step, 1)
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % step == 0

    def validate(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "moe_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} is larger than "
                f"num_experts={self.num_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be positive")
        if self.is_deepseek:
            self._validate_deepseek()
        elif self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"num_attention_heads={self.num_attention_heads} does not divide "
                    f"hidden_size={self.hidden_size} (and no head_dim is given)"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads

    def _validate_deepseek(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ConfigError(
                f"n_group={self.n_group} must be positive and divide n_routed_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        per_group = self.num_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in "
                f"topk_group={self.topk_group} groups of {per_group}"
            )
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ConfigError(
                f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                f"[0, num_hidden_layers={self.num_hidden_layers}]"
            )
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"scoring_func={self.scoring_func!r} must be 'softmax' or 'sigmoid'")

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config (a dict, a ``config.json`` or a directory holding one)."""
        raw = _read_json(path_or_dict) if not isinstance(path_or_dict, dict) else path_or_dict
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ConfigError(f"{flag}=true is not supported: our linears have no bias")
        reader = _Reader(raw)
        common = dict(
            model_type=model_type,
            vocab_size=reader.get("vocab_size"),
            hidden_size=reader.get("hidden_size"),
            num_hidden_layers=reader.get("num_hidden_layers"),
            num_attention_heads=reader.get("num_attention_heads"),
            num_key_value_heads=reader.get("num_key_value_heads", raw.get("num_attention_heads")),
            intermediate_size=reader.get("intermediate_size"),
            moe_intermediate_size=reader.get("moe_intermediate_size"),
            num_experts_per_tok=reader.get("num_experts_per_tok"),
            rms_norm_eps=float(reader.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(raw)),
            max_position_embeddings=reader.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=_first_eos(raw.get("eos_token_id")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", model_type != "deepseek_v2")),
        )
        if model_type == "qwen3_moe":
            return cls(
                **common,
                num_experts=reader.get_any("num_experts", "num_local_experts"),
                head_dim=raw.get("head_dim"),
                mlp_only_layers=list(raw.get("mlp_only_layers") or []),
                decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            )
        v3 = model_type == "deepseek_v3"
        return cls(
            **common,
            num_experts=reader.get("n_routed_experts"),
            first_k_dense_replace=reader.get("first_k_dense_replace", 0),
            n_shared_experts=raw.get("n_shared_experts") or 0,
            n_group=raw.get("n_group") or 1,
            topk_group=raw.get("topk_group") or 1,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            scoring_func=raw.get("scoring_func", "sigmoid" if v3 else "softmax"),
            topk_method=raw.get("topk_method", "noaux_tc" if v3 else "greedy"),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=reader.get("kv_lora_rank"),
            qk_nope_head_dim=reader.get("qk_nope_head_dim"),
            qk_rope_head_dim=reader.get("qk_rope_head_dim"),
            v_head_dim=reader.get("v_head_dim"),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict that ``from_hf`` (and ``transformers``) reads back."""
        d = dataclasses.asdict(self)
        common = [
            "model_type",
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "moe_intermediate_size",
            "num_experts_per_tok",
            "norm_topk_prob",
            "rms_norm_eps",
            "rope_theta",
            "max_position_embeddings",
            "tie_word_embeddings",
            "eos_token_id",
        ]
        out = {key: d[key] for key in common}
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        out["architectures"] = [_ARCHITECTURES[self.model_type]]
        if not self.is_deepseek:
            out.update(
                num_experts=self.num_experts,
                head_dim=self.head_dim,
                mlp_only_layers=self.mlp_only_layers,
                decoder_sparse_step=self.decoder_sparse_step,
            )
            return out
        out["n_routed_experts"] = self.num_experts
        for key in (
            "first_k_dense_replace",
            "n_shared_experts",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "scoring_func",
            "topk_method",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "rope_interleave",
        ):
            out[key] = d[key]
        return out


@dataclass
class ParallelConfig:
    """How many ranks, and how they are laid out (see distributed/groups.py)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    enable_dp_attention: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name}={value!r} must be a positive integer")


class _Reader:
    """Reads required fields and names the missing one."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def get(self, key: str, default: Any = ...) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is ...:
            raise ConfigError(f"config.json is missing the required field {key!r}")
        return default

    def get_any(self, *keys: str) -> Any:
        for key in keys:
            if self.raw.get(key) is not None:
                return self.raw[key]
        raise ConfigError(
            f"config.json is missing the required field {' or '.join(map(repr, keys))}"
        )


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    return raw


def _rope_theta(raw: dict[str, Any]) -> float:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise ConfigError(f"rope scaling {scaling!r} is not supported; only default RoPE")
    return params.get("rope_theta", raw.get("rope_theta", 10000.0))


def _first_eos(eos: Any) -> int | None:
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos


OVERLAP_MODES = ("none", "tbo", "sbo", "dbo")
A2A_BACKENDS = ("none", "local", "torch")


@dataclass
class OverlapConfig:
    """Which overlap scheme runs, and its knobs (the reference systems' flag names)."""

    mode: str = "none"  # none | tbo | sbo | dbo
    tbo_token_distribution_threshold: float = 0.48  # two-chunk split; 0 disables it
    num_micro_batches: int = 2
    tbo_min_tokens: int = 2  # a rank with fewer tokens votes against micro-batching this step
    # where two-chunk cuts: "tokens" halves the tokens (SGLang), "time" balances estimated cost
    tbo_split_policy: str = "tokens"
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    moe_a2a_backend: str = "torch"
    sbo_combine_blocks: int = 2  # SBO: combine all-to-alls per MoE layer (local expert blocks)
    sbo_comm_sms: int = 3  # SBO on CUDA: SMs reserved for communication (SGLang, Hopper)

    def __post_init__(self) -> None:
        if self.tbo_split_policy not in ("tokens", "time"):
            raise ConfigError(
                f"--tbo-split-policy={self.tbo_split_policy!r} must be tokens or time"
            )
        if self.mode not in OVERLAP_MODES:
            raise ConfigError(f"overlap={self.mode!r} must be one of {', '.join(OVERLAP_MODES)}")
        if self.moe_a2a_backend not in A2A_BACKENDS:
            raise ConfigError(
                f"--moe-a2a-backend={self.moe_a2a_backend!r} must be one of "
                f"{', '.join(A2A_BACKENDS)}"
            )
        if not 0 <= self.tbo_token_distribution_threshold <= 0.5:
            raise ConfigError(
                f"--tbo-token-distribution-threshold={self.tbo_token_distribution_threshold} "
                "must be in [0, 0.5] (0 disables two-chunk splitting; default 0.48)"
            )
        if self.tbo_min_tokens < 1:
            raise ConfigError(f"--tbo-min-tokens={self.tbo_min_tokens} must be >= 1")
        if self.num_micro_batches < 2:
            raise ConfigError(f"num_micro_batches={self.num_micro_batches} must be >= 2")
        if self.mode == "tbo" and self.moe_a2a_backend == "none":
            raise ConfigError(
                "--enable-two-batch-overlap needs an all-to-all backend; "
                "set --moe-a2a-backend to torch (or local on one rank)"
            )
        for name in ("sbo_combine_blocks", "sbo_comm_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be an integer >= 1")
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1")
