"""The model's configuration: one dataclass for every family, validated field by field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_overlap.core.errors import ConfigError, is_finite_number, is_int
from moe_overlap.core.family_checks import (
    validate_deepseek_moe,
    validate_hybrid,
    validate_mimo,
    validate_windowed,
)
from moe_overlap.core.hf_config import check_model_type, fields_from_hf, hf_from_fields, read_json

_POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "max_position_embeddings",
    "decoder_sparse_step",
    "n_group",
    "topk_group",
)
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
_BOOLS = (
    "norm_topk_prob",
    "tie_word_embeddings",
    "rope_interleave",
    "attention_bias",
    "use_qk_norm",
)
_DEEPSEEK_DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_SCORING, _TOPK = ("softmax", "sigmoid"), ("greedy", "noaux_tc", "group_limited_greedy")
_CHOICES = {"scoring_func": _SCORING, "topk_method": _TOPK}


@dataclass
class ModelConfig:
    """Everything the model code needs. Every field is checked on construction, and a bad one
    raises ``ConfigError`` naming it."""

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
    # the MTP drafter's layers (model/mtp.py): DeepSeek-V3's and GLM-4.5's after the last
    # decoder layer (``model.layers.{num_hidden_layers + i}``), Qwen3.5's ``mtp.*``
    num_nextn_predict_layers: int = 0
    # Qwen3.5-MoE: which layers are Gated DeltaNet (linear attention) and their shapes; the
    # full-attention layers rotate only the first partial_rotary_factor of each head.
    layer_types: list[str] = field(default_factory=list)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0  # one gated shared expert of this width
    partial_rotary_factor: float = 1.0
    # GLM-4.5: biased q/k/v projections, optional per-head q/k norm
    attention_bias: bool = False
    use_qk_norm: bool = True
    # GPT-OSS: "sliding_attention" layers (layer_types) see the last sliding_window keys; every
    # layer has learned sinks; YaRN RoPE (rope_scaling); experts with biases and a clamped
    # SwiGLU (swiglu_limit 0: plain SwiGLU)
    sliding_window: int = 0
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 0.0
    # MiMo-V2-Flash: its sliding layers' KV heads and RoPE base; V scaled after its projection
    # (v_head_dim: the V heads' width, narrower than head_dim)
    swa_num_key_value_heads: int = 0
    swa_rope_theta: float = 0.0
    attention_value_scale: float = 1.0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_deepseek(self) -> bool:
        return self.model_type.startswith("deepseek")

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention with a per-sequence recurrent state."""
        return self.model_type == "qwen3_5_moe"

    def layer_type(self, layer_id: int) -> str:
        """The layer's kind; one past ``layer_types`` is an MTP layer (MiMo's: sliding)."""
        kinds = self.layer_types or []
        past = "sliding_attention" if self.is_mimo else "full_attention"
        return kinds[layer_id] if layer_id < len(kinds) else past

    def is_linear_layer(self, layer_id: int) -> bool:
        return self.is_hybrid and self.layer_type(layer_id) == "linear_attention"

    def window(self, layer_id: int) -> int:
        """The keys a query of this layer sees, itself included (0: all before it)."""
        sliding = self.layer_type(layer_id) == "sliding_attention"
        return self.sliding_window if sliding else 0

    def has_sinks(self, layer_id: int) -> bool:
        """The layer's softmax has a learned per-head sink (GPT-OSS: every layer; MiMo: the
        sliding ones)."""
        return self.is_gpt_oss or (self.is_mimo and self.window(layer_id) > 0)

    def kv_heads(self, layer_id: int) -> int:
        if self.is_mimo and self.window(layer_id):
            return self.swa_num_key_value_heads
        return self.num_key_value_heads

    def rope_base(self, layer_id: int) -> float:
        return self.swa_rope_theta if self.is_mimo and self.window(layer_id) else self.rope_theta

    @property
    def value_head_size(self) -> int:
        """The V heads' width (MiMo's are narrower than its Q/K heads)."""
        return self.v_head_dim if self.is_mimo else self.head_size

    @property
    def is_gpt_oss(self) -> bool:
        return self.model_type == "gpt_oss"

    @property
    def is_mimo(self) -> bool:
        return self.model_type == "mimo_v2_flash"

    def max_len(self, max_model_len: int | None = None) -> int:
        """The longest sequence served: ``max_model_len``, at most the model's positions."""
        return min(max_model_len or self.max_position_embeddings, self.max_position_embeddings)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def head_size(self) -> int:
        """``head_dim`` once validated (``validate`` fills it in when the config gives none)."""
        assert self.head_dim is not None, "read before validate()"
        return self.head_dim

    @property
    def deepseek_moe(self) -> bool:
        """DeepSeek-V3's MoE: grouped routing, shared experts, dense first layers (GLM-4.5 and
        MiMo-V2-Flash too, MiMo's dense layers listed in mlp_only_layers)."""
        return self.is_deepseek or self.model_type in ("glm4_moe", "mimo_v2_flash")

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.is_mimo and layer_id >= self.num_hidden_layers:  # its MTP layers: dense MLPs
            return False
        if self.deepseek_moe:
            return layer_id >= self.first_k_dense_replace and layer_id not in self.mlp_only_layers
        return (
            layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config (a dict, a ``config.json`` or a directory holding one)."""
        raw = path_or_dict if isinstance(path_or_dict, dict) else read_json(path_or_dict)
        return cls(**fields_from_hf(raw))

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` dict that ``from_hf`` (and ``transformers``) reads back."""
        return hf_from_fields(dataclasses.asdict(self))

    def validate(self) -> None:
        check_model_type(self.model_type)
        for name in _POSITIVE_INTS:
            _require_int(name, getattr(self, name), minimum=1)
        for name in _POSITIVE_FLOATS:
            setattr(self, name, _require_positive_float(name, getattr(self, name)))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be true or false")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} must be one of {', '.join(choices)}"
                )
        if self.eos_token_id is not None:
            _require_int("eos_token_id", self.eos_token_id, minimum=0)
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
        if self.deepseek_moe:
            validate_deepseek_moe(self)
        if self.is_deepseek:
            self._validate_mla()
        else:
            self._validate_qwen3()
        _require_int("num_nextn_predict_layers", self.num_nextn_predict_layers, minimum=0)
        if self.is_hybrid:
            validate_hybrid(self)
        if self.model_type == "glm4_moe":
            self.validate_rotary()
        if self.is_gpt_oss or self.is_mimo:
            validate_windowed(self)
        if self.is_mimo:
            validate_mimo(self)

    def _validate_qwen3(self) -> None:
        if not isinstance(self.mlp_only_layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers
            for i in self.mlp_only_layers
        ):
            raise ConfigError(
                f"mlp_only_layers={self.mlp_only_layers!r} must list layer indices in "
                f"[0, num_hidden_layers={self.num_hidden_layers})"
            )
        if self.head_dim is not None:
            _require_int("head_dim", self.head_dim, minimum=1)
            return
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size} (and no head_dim is given)"
            )
        self.head_dim = self.hidden_size // self.num_attention_heads

    def _validate_mla(self) -> None:
        for name in _DEEPSEEK_DIMS:
            _require_int(name, getattr(self, name), minimum=1)
        if self.q_lora_rank is not None:
            _require_int("q_lora_rank", self.q_lora_rank, minimum=1)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    def validate_rotary(self) -> None:
        if not is_finite_number(self.partial_rotary_factor) or not (
            0 < self.partial_rotary_factor <= 1
        ):
            raise ConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1]"
            )
        if self.rotary_dim % 2:
            raise ConfigError(
                f"head_dim={self.head_dim} x partial_rotary_factor={self.partial_rotary_factor}"
                f" = {self.rotary_dim} rotary dims must be even"
            )


def _require_int(name: str, value: Any, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{name}={value!r} must be {kind}")


def _require_positive_float(name: str, value: Any) -> float:
    if not is_finite_number(value):
        raise ConfigError(f"{name}={value!r} must be a finite number")
    if value <= 0:
        raise ConfigError(f"{name}={value!r} must be positive")
    return float(value)
