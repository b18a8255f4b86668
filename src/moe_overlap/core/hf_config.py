"""Reading and writing Hugging Face ``config.json`` files as ``ModelConfig`` fields.

Pure dict work: ``fields_from_hf`` turns a config dict into ``ModelConfig`` keyword arguments,
``hf_from_fields`` does the reverse; ``model_config.py`` builds and validates the dataclass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.hf_families import (
    YARN_KEYS,
    Reader,
    glm4_fields,
    gpt_oss_fields,
    mimo_fields,
    mimo_hf,
    qwen3_5_fields,
    rope_kind,
    rope_params,
    yarn_scaling,
)

SUPPORTED_MODEL_TYPES = (
    "qwen3_moe",
    "qwen3_5_moe",
    "glm4_moe",
    "gpt_oss",
    "mimo_v2_flash",
    "deepseek_v3",
    "deepseek_v2",
)
_ARCHITECTURES = {
    "gpt_oss": "GptOssForCausalLM",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
}
_COMMON = (
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
)
_QWEN3 = ("head_dim", "mlp_only_layers", "decoder_sparse_step")
_GLM4 = (
    "head_dim",
    "first_k_dense_replace",
    "n_shared_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "attention_bias",
    "use_qk_norm",
    "num_nextn_predict_layers",
)
_GPT_OSS = (
    "layer_types",
    "sliding_window",
    "attention_bias",
    "swiglu_alpha",
    "swiglu_limit",
)
_QWEN3_5 = (
    "head_dim",
    "layer_types",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "shared_expert_intermediate_size",
)
# the Hub's multimodal Qwen3.5 config nests the language model's fields under text_config,
# whose own model_type names the text model
_TEXT_TYPES = {"qwen3_5_moe_text": "qwen3_5_moe"}
_DEEPSEEK = (
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
    "num_nextn_predict_layers",
)


def check_model_type(model_type: Any) -> str:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def read_json(path: str | Path) -> dict[str, Any]:
    """The dict in ``path`` (a ``config.json`` or a directory holding one)."""
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


def fields_from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments from a Hugging Face config dict (types unchecked:
    ``ModelConfig`` validates every field and names the bad one)."""
    raw = _text_part(raw)
    model_type = check_model_type(raw.get("model_type"))
    _refuse_biases(raw, model_type)
    reader = Reader(raw)
    common = _common_fields(raw, reader, model_type)
    if model_type == "qwen3_moe":
        return common | _qwen3_fields(raw, reader)
    if model_type == "qwen3_5_moe":
        return common | qwen3_5_fields(raw, reader)
    if model_type == "glm4_moe":
        return common | glm4_fields(raw, reader)
    if model_type == "gpt_oss":
        return common | gpt_oss_fields(raw, reader)
    if model_type == "mimo_v2_flash":
        return common | mimo_fields(raw, reader)
    return common | _deepseek_fields(raw, reader, v3=model_type == "deepseek_v3")


def _refuse_biases(raw: dict[str, Any], model_type: str) -> None:
    """Linear biases only where the family has them (GLM-4.5's and GPT-OSS's attention)."""
    for flag in ("attention_bias", "mlp_bias"):
        biased = flag == "attention_bias" and model_type in ("glm4_moe", "gpt_oss")
        if raw.get(flag) and not biased:
            raise ConfigError(f"{flag}=true is not supported for {model_type}")


def _common_fields(raw: dict[str, Any], reader: Reader, model_type: str) -> dict[str, Any]:
    """The fields every family has (``_COMMON``), with each family's defaults."""
    oss = model_type == "gpt_oss"
    return dict(
        model_type=model_type,
        vocab_size=reader.get("vocab_size"),
        hidden_size=reader.get("hidden_size"),
        num_hidden_layers=reader.get("num_hidden_layers"),
        num_attention_heads=reader.get("num_attention_heads"),
        num_key_value_heads=reader.get("num_key_value_heads", raw.get("num_attention_heads")),
        # Qwen3.5 has no dense MLP layer, and no dense width
        intermediate_size=reader.get("intermediate_size")
        if model_type != "qwen3_5_moe"
        else raw.get("intermediate_size") or reader.get("moe_intermediate_size"),
        # GPT-OSS names the experts' width intermediate_size (its reader fills these two)
        moe_intermediate_size=reader.get("moe_intermediate_size") if not oss else None,
        num_experts_per_tok=reader.get("num_experts_per_tok") if not oss else None,
        rms_norm_eps=reader.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(raw, model_type),
        max_position_embeddings=reader.get("max_position_embeddings", 4096),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        eos_token_id=_first_eos(raw.get("eos_token_id")),
        norm_topk_prob=raw.get("norm_topk_prob", model_type != "deepseek_v2"),
    )


def _qwen3_fields(raw: dict[str, Any], reader: Reader) -> dict[str, Any]:
    return dict(
        num_experts=reader.get_any("num_experts", "num_local_experts"),
        head_dim=raw.get("head_dim"),
        mlp_only_layers=raw.get("mlp_only_layers") or [],
        decoder_sparse_step=raw.get("decoder_sparse_step", 1),
    )


def _deepseek_fields(raw: dict[str, Any], reader: Reader, v3: bool) -> dict[str, Any]:
    """DeepSeek-V2's and V3's fields (MLA, grouped routing), with each version's defaults."""
    return dict(
        num_experts=reader.get("n_routed_experts"),
        first_k_dense_replace=reader.get("first_k_dense_replace", 0),
        n_shared_experts=raw.get("n_shared_experts") or 0,
        n_group=raw.get("n_group") or 1,
        topk_group=raw.get("topk_group") or 1,
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
        scoring_func=raw.get("scoring_func", "sigmoid" if v3 else "softmax"),
        topk_method=raw.get("topk_method", "noaux_tc" if v3 else "greedy"),
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=reader.get("kv_lora_rank"),
        qk_nope_head_dim=reader.get("qk_nope_head_dim"),
        qk_rope_head_dim=reader.get("qk_rope_head_dim"),
        v_head_dim=reader.get("v_head_dim"),
        rope_interleave=raw.get("rope_interleave", True),
        num_nextn_predict_layers=raw.get("num_nextn_predict_layers") or 0,
        rope_scaling=yarn_scaling(raw),
    )


def hf_from_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``config.json`` dict that ``fields_from_hf`` (and ``transformers``)
    reads back."""
    out = {key: fields[key] for key in _COMMON}
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": fields["rope_theta"]}
    out["architectures"] = [_ARCHITECTURES[fields["model_type"]]]
    if fields["model_type"] == "qwen3_moe":
        return out | {"num_experts": fields["num_experts"]} | {k: fields[k] for k in _QWEN3}
    if fields["model_type"] == "glm4_moe":
        out["rope_parameters"]["partial_rotary_factor"] = fields["partial_rotary_factor"]
        return out | {"n_routed_experts": fields["num_experts"]} | {k: fields[k] for k in _GLM4}
    out["rope_parameters"] |= fields.get("rope_scaling") or {}  # YaRN: GPT-OSS's, DeepSeek's
    if fields["model_type"] == "gpt_oss":
        out |= {"num_local_experts": fields["num_experts"], "head_dim": fields["head_dim"]}
        del out["moe_intermediate_size"], out["norm_topk_prob"]  # intermediate_size says it
        return out | {k: fields[k] for k in _GPT_OSS}
    if fields["model_type"] == "mimo_v2_flash":
        return out | mimo_hf(fields)
    if fields["model_type"] == "qwen3_5_moe":
        out["rope_parameters"]["partial_rotary_factor"] = fields["partial_rotary_factor"]
        out["model_type"] = "qwen3_5_moe_text"  # what transformers' causal LM class reads
        if fields["num_nextn_predict_layers"]:  # its mtp.* layers
            out["mtp_num_hidden_layers"] = fields["num_nextn_predict_layers"]
        return out | {"num_experts": fields["num_experts"]} | {k: fields[k] for k in _QWEN3_5}
    return out | {"n_routed_experts": fields["num_experts"]} | {k: fields[k] for k in _DEEPSEEK}


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields: ``text_config`` when the config nests them there."""
    if isinstance(raw.get("text_config"), dict):
        raw = raw["text_config"] | {"tie_word_embeddings": raw.get("tie_word_embeddings", False)}
    if raw.get("model_type") in _TEXT_TYPES:
        raw = raw | {"model_type": _TEXT_TYPES[raw["model_type"]]}
    return raw


YARN_FAMILIES = ("gpt_oss", "deepseek_v3", "deepseek_v2")


def _rope_theta(raw: dict[str, Any], model_type: str) -> Any:
    # transformers 5 nests it under rope_parameters; older configs keep it at the top.
    params = raw.get("rope_parameters") or {}
    scaling = rope_params(raw)
    # Qwen3.5's multimodal RoPE (mrope) is plain RoPE for text, where its three position ids
    # are equal; GPT-OSS's and DeepSeek's YaRN are computed (model/rope.py)
    kind = rope_kind(scaling)
    if kind not in ("default", None) and not (model_type in YARN_FAMILIES and kind == "yarn"):
        raise ConfigError(
            f"rope scaling {scaling!r} is not supported for {model_type}; only default RoPE"
            + (f" (and YaRN for {', '.join(YARN_FAMILIES)})" if kind == "yarn" else "")
        )
    if kind == "yarn" and set(scaling) - {"rope_type", "type", "rope_theta", *YARN_KEYS}:
        unknown = sorted(set(scaling) - {"rope_type", "type", "rope_theta", *YARN_KEYS})
        raise ConfigError(f"YaRN parameters {unknown} are not supported; known: {YARN_KEYS}")
    default = 150000.0 if model_type == "gpt_oss" else 10000.0  # transformers' defaults
    return params.get("rope_theta", raw.get("rope_theta", default))


def _first_eos(eos: Any) -> Any:
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos
