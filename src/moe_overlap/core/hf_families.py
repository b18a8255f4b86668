"""The family-specific parts of reading a Hugging Face ``config.json`` (Qwen3.5, GLM-4.5,
GPT-OSS, MiMo-V2-Flash): each turns the dict into its ``ModelConfig`` keyword arguments."""

from __future__ import annotations

from typing import Any

from moe_overlap.core.errors import ConfigError

YARN_KEYS = (
    "factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
    "truncate",
    "attention_factor",
    "mscale",  # DeepSeek's: the attention factor is mscale's over mscale_all_dim's
    "mscale_all_dim",  # DeepSeek's: MLA's softmax scale times its mscale, squared
)

_MIMO = (
    "head_dim",
    "v_head_dim",
    "layer_types",
    "sliding_window",
    "swa_num_key_value_heads",
    "attention_value_scale",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "attention_bias",
    "num_nextn_predict_layers",
)


class Reader:
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


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """RoPE's parameters: transformers 5's ``rope_parameters`` or the older ``rope_scaling``."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_scaling={params!r} must be an object")
    return params


def rope_kind(params: dict[str, Any]) -> str | None:
    """A RoPE parameter dict's kind (transformers 5's ``rope_type``, older configs' ``type``)."""
    return params.get("rope_type", params.get("type", "default"))


def yarn_scaling(raw: dict[str, Any]) -> dict[str, Any]:
    """YaRN's parameters as ``ModelConfig.rope_scaling`` holds them ({} for default RoPE)."""
    params = rope_params(raw)
    kind = rope_kind(params)
    known = {k: params[k] for k in YARN_KEYS if params.get(k) is not None}
    return known | {"rope_type": kind} if kind not in ("default", None) else {}


def qwen3_5_fields(raw: dict[str, Any], reader: Reader) -> dict[str, Any]:
    for flag in ("attn_output_gate",):
        if raw.get(flag) is False:
            raise ConfigError(f"{flag}=false is not supported: Qwen3.5's attention is gated")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return dict(
        num_experts=reader.get_any("num_experts", "num_local_experts"),
        head_dim=raw.get("head_dim"),
        layer_types=raw.get("layer_types") or _default_layer_types(reader),
        linear_conv_kernel_dim=raw.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=raw.get("linear_key_head_dim", 128),
        linear_value_head_dim=raw.get("linear_value_head_dim", 128),
        linear_num_key_heads=raw.get("linear_num_key_heads", 16),
        linear_num_value_heads=raw.get("linear_num_value_heads", 32),
        shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size", 0),
        num_nextn_predict_layers=raw.get("mtp_num_hidden_layers") or 0,  # its mtp.* layers
        partial_rotary_factor=params.get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)
        ),
    )


def glm4_fields(raw: dict[str, Any], reader: Reader) -> dict[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return dict(
        num_experts=reader.get_any("n_routed_experts", "num_local_experts"),
        head_dim=raw.get("head_dim"),
        first_k_dense_replace=raw.get("first_k_dense_replace", 1),
        n_shared_experts=raw.get("n_shared_experts", 1),
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        attention_bias=raw.get("attention_bias", False),
        use_qk_norm=raw.get("use_qk_norm", False),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
        partial_rotary_factor=params.get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)
        ),
    )


def gpt_oss_fields(raw: dict[str, Any], reader: Reader) -> dict[str, Any]:
    """GPT-OSS: every layer MoE (``intermediate_size`` is the experts' width), top-k over the
    router's biased logits then softmax over the chosen, YaRN RoPE, sliding layers."""
    width = reader.get("intermediate_size")
    return dict(
        num_experts=reader.get_any("num_local_experts", "num_experts"),
        num_experts_per_tok=reader.get_any("num_experts_per_tok", "experts_per_token"),
        intermediate_size=width,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        head_dim=raw.get("head_dim"),
        layer_types=raw.get("layer_types") or _alternating_layer_types(reader),
        sliding_window=raw.get("sliding_window") or 0,
        attention_bias=raw.get("attention_bias", True),
        use_qk_norm=False,
        rope_scaling=yarn_scaling(raw),
        swiglu_alpha=raw.get("swiglu_alpha", 1.702),
        swiglu_limit=raw.get("swiglu_limit", 7.0),
    )


def _alternating_layer_types(reader: Reader) -> list[str]:
    # transformers' GPT-OSS default: sliding, full, sliding, full, ...
    n = reader.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ConfigError(f"num_hidden_layers={n!r} must be a positive integer")
    return ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]


def _default_layer_types(reader: Reader) -> list[str]:
    # transformers' default: every fourth layer full attention, the rest linear
    n = reader.get("num_hidden_layers")
    interval = reader.raw.get("full_attention_interval", 4)
    if not isinstance(n, int) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(
            f"num_hidden_layers={n!r} and full_attention_interval={interval!r} must be "
            "positive integers (or give layer_types)"
        )
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def mimo_fields(raw: dict[str, Any], reader: Reader) -> dict[str, Any]:
    """MiMo-V2-Flash: sliding layers (with twice the KV heads and a sink per head) beside full
    ones, each kind with its own RoPE base; partial RoPE; K heads wider than V heads with V
    scaled; DeepSeek-V3's sigmoid routing without shared experts; dense layers by
    ``mlp_layer_types``; ``num_nextn_predict_layers`` MTP layers (``model.mtp.layers.*``).
    Reads transformers' names and the Hub's (``hybrid_layer_pattern``, ``moe_layer_freq``,
    ``sliding_window_size``, ``swa_*``, ``layernorm_epsilon``)."""
    n = reader.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ConfigError(f"num_hidden_layers={n!r} must be a positive integer")
    kinds = raw.get("layer_types") or _from_pattern(raw.get("hybrid_layer_pattern"), n)
    mlp = raw.get("mlp_layer_types") or _mlp_from_freq(raw.get("moe_layer_freq"), n)
    per_kind = raw.get("rope_parameters") or {}
    full = per_kind.get("full_attention") or {}
    swa = per_kind.get("sliding_attention") or {}
    window = raw.get("sliding_window", 129)
    if raw.get("sliding_window_size") is not None:  # the Hub's: keys before the query
        window = raw["sliding_window_size"] + 1
    for name in ("swa_head_dim", "swa_v_head_dim", "swa_num_attention_heads"):
        plain = {"swa_head_dim": "head_dim", "swa_v_head_dim": "v_head_dim"}.get(
            name, "num_attention_heads"
        )
        if raw.get(name) is not None and raw[name] != raw.get(plain, raw[name]):
            raise ConfigError(
                f"{name}={raw[name]} differs from {plain}={raw.get(plain)}: sliding layers with "
                "other head shapes than the full layers are not supported (transformers' "
                "MiMo-V2-Flash has none)"
            )
    if raw.get("add_full_attention_sink_bias"):
        raise ConfigError("add_full_attention_sink_bias=true is not supported for mimo_v2_flash")
    factor = full.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.334))
    if swa.get("partial_rotary_factor", factor) != factor:
        raise ConfigError(
            f"partial_rotary_factor {swa['partial_rotary_factor']} (sliding layers) differs from "
            f"{factor} (full layers); one factor for both is supported"
        )
    return _hub_eps(raw) | dict(
        num_experts=reader.get_any("n_routed_experts", "num_local_experts"),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
        head_dim=raw.get("head_dim", 192),
        v_head_dim=raw.get("v_head_dim", 128),
        layer_types=kinds,
        mlp_only_layers=[i for i, kind in enumerate(mlp) if kind == "dense"],
        sliding_window=window,
        swa_num_key_value_heads=raw.get("swa_num_key_value_heads")
        or 2 * reader.get("num_key_value_heads"),
        rope_theta=full.get("rope_theta", raw.get("rope_theta", 5_000_000.0)),
        swa_rope_theta=swa.get("rope_theta", raw.get("swa_rope_theta", 10_000.0)),
        partial_rotary_factor=factor,
        attention_value_scale=raw.get("attention_value_scale") or 1.0,
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=raw.get("routed_scaling_factor") or 1.0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        attention_bias=raw.get("attention_bias", False),
        use_qk_norm=False,
    )


def _hub_eps(raw: dict[str, Any]) -> dict[str, Any]:
    """The norms' epsilon where only the Hub's name for it, ``layernorm_epsilon``, is given."""
    if raw.get("rms_norm_eps") is None and raw.get("layernorm_epsilon") is not None:
        return {"rms_norm_eps": raw["layernorm_epsilon"]}
    return {}


def _from_pattern(pattern: Any, n: int) -> list[str]:
    if pattern is None:  # transformers' default: full at 0 and every sixth layer
        return [
            "full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(n)
        ]
    return ["sliding_attention" if p else "full_attention" for p in pattern]


def _mlp_from_freq(freq: Any, n: int) -> list[str]:
    if freq is None:  # transformers' default: the first layer dense
        return ["dense"] + ["sparse"] * (n - 1)
    return ["sparse" if f else "dense" for f in freq]


def mimo_hf(fields: dict[str, Any]) -> dict[str, Any]:
    """MiMo-V2-Flash's fields in transformers' names (``hf_from_fields``)."""
    factor = fields["partial_rotary_factor"]
    n = fields["num_hidden_layers"]
    return {
        "n_routed_experts": fields["num_experts"],
        "mlp_layer_types": [
            "dense" if i in fields["mlp_only_layers"] else "sparse" for i in range(n)
        ],
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
            for kind, theta in (
                ("full_attention", fields["rope_theta"]),
                ("sliding_attention", fields["swa_rope_theta"]),
            )
        },
    } | {k: fields[k] for k in _MIMO}
