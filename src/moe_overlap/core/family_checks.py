"""Validation of the families whose layers differ by kind: Qwen3.5's linear-attention layers,
GPT-OSS's and MiMo-V2-Flash's sliding-window layers (the window, YaRN's parameters, the clamped
SwiGLU, MiMo's sliding layers' KV heads and RoPE base)."""

from __future__ import annotations

from typing import Any, Protocol

from moe_overlap.core.errors import ConfigError, is_finite_number, is_int


class ModelConfig(Protocol):
    """What these checks read of ``model_config.py: ModelConfig`` (which calls in here)."""

    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    v_head_dim: int
    layer_types: list[str]
    linear_num_key_heads: int
    linear_num_value_heads: int
    shared_expert_intermediate_size: int
    sliding_window: int
    rope_scaling: dict[str, Any]
    swa_num_key_value_heads: int

    def validate_rotary(self) -> None: ...


LAYER_KINDS = ("sliding_attention", "full_attention")
_LINEAR_DIMS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def validate_hybrid(cfg: ModelConfig) -> None:
    kinds = ("linear_attention", "full_attention")
    if (
        not isinstance(cfg.layer_types, list)
        or len(cfg.layer_types) != cfg.num_hidden_layers
        or any(t not in kinds for t in cfg.layer_types)
    ):
        raise ConfigError(
            f"layer_types={cfg.layer_types!r} must list {cfg.num_hidden_layers} entries "
            f"(num_hidden_layers), each one of {', '.join(kinds)}"
        )
    for name in _LINEAR_DIMS:
        _require_int(name, getattr(cfg, name), 1)
    _require_int("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size, 0)
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"linear_num_key_heads={cfg.linear_num_key_heads} must divide "
            f"linear_num_value_heads={cfg.linear_num_value_heads}"
        )
    cfg.validate_rotary()


def _require_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{name}={value!r} must be {kind}")


def validate_windowed(cfg: ModelConfig) -> None:
    n, kinds = cfg.num_hidden_layers, cfg.layer_types
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in LAYER_KINDS for k in kinds):
        raise ConfigError(
            f"layer_types={kinds!r} must list {n} entries (num_hidden_layers), each one of "
            f"{', '.join(LAYER_KINDS)}"
        )
    if "sliding_attention" in kinds and (not is_int(cfg.sliding_window) or cfg.sliding_window < 1):
        raise ConfigError(
            f"sliding_window={cfg.sliding_window!r} must be a positive integer: layer_types "
            "has sliding_attention layers"
        )
    for name in ("swiglu_alpha", "swiglu_limit"):
        value = getattr(cfg, name)
        if not is_finite_number(value) or value < 0:
            raise ConfigError(f"{name}={value!r} must be a finite number >= 0")
    _validate_yarn(cfg.rope_scaling)


def _validate_yarn(params: object) -> None:
    if not isinstance(params, dict):
        raise ConfigError(f"rope_scaling={params!r} must be an object")
    if not params:
        return
    if params.get("rope_type") != "yarn":
        raise ConfigError(f"rope_scaling={params!r}: only rope_type 'yarn' is supported")
    for key in ("factor", "original_max_position_embeddings"):
        value = params.get(key)
        if not is_finite_number(value) or value <= 0:
            raise ConfigError(f"YaRN's {key}={value!r} must be a positive number")
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        value = params.get(key)
        if value is not None and (not is_finite_number(value) or value <= 0):
            raise ConfigError(f"YaRN's {key}={value!r} must be a positive number")
    for key in ("mscale", "mscale_all_dim"):
        value = params.get(key)
        if value is not None and (not is_finite_number(value) or value < 0):
            raise ConfigError(f"YaRN's {key}={value!r} must be a number >= 0")


def validate_mimo(cfg: ModelConfig) -> None:
    _require_int("v_head_dim", cfg.v_head_dim, 1)
    _require_int("swa_num_key_value_heads", cfg.swa_num_key_value_heads, 1)
    if cfg.num_attention_heads % cfg.swa_num_key_value_heads:
        raise ConfigError(
            f"swa_num_key_value_heads={cfg.swa_num_key_value_heads} does not divide "
            f"num_attention_heads={cfg.num_attention_heads}"
        )
    for name in ("swa_rope_theta", "attention_value_scale"):
        value = getattr(cfg, name)
        if not is_finite_number(value) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive number")
    cfg.validate_rotary()


def validate_deepseek_moe(cfg: ModelConfig) -> None:
    _validate_yarn(cfg.rope_scaling)  # DeepSeek-V3's checkpoints stretch RoPE with YaRN
    _require_int("n_shared_experts", cfg.n_shared_experts, minimum=0)
    _require_int("first_k_dense_replace", cfg.first_k_dense_replace, minimum=0)
    if cfg.num_experts % cfg.n_group:
        raise ConfigError(
            f"n_group={cfg.n_group} must be positive and divide n_routed_experts={cfg.num_experts}"
        )
    if cfg.topk_group > cfg.n_group:
        raise ConfigError(f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]")
    per_group = cfg.num_experts // cfg.n_group
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        raise ConfigError(
            f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in "
            f"topk_group={cfg.topk_group} groups of {per_group}"
        )
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        raise ConfigError(
            f"first_k_dense_replace={cfg.first_k_dense_replace} must be in "
            f"[0, num_hidden_layers={cfg.num_hidden_layers}]"
        )
