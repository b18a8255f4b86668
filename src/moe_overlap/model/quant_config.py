"""A checkpoint's ``quantization_config``: which FP8 layout its weights are in, or a refusal
that names the method and the way round it.

Read here: ``quant_method: "fp8"`` (``fmt`` e4m3), either block-wise (``weight_block_size``
``[rows, cols]``, each quantized ``X.weight`` beside ``X.weight_scale_inv`` of
``[ceil(N / rows), ceil(K / cols)]``: DeepSeek-V3's, Qwen3's, Qwen3.5's and MiMo-V2-Flash's) or,
with no block size, a ``X.weight_scale`` per tensor (``[]``/``[1]``) or per output channel
(``[N]``/``[N, 1]``); and llm-compressor's ``quant_method: "compressed-tensors"`` in its
``float-quantized`` format with 8-bit float weights (GLM-4.5's ``-FP8``), whose ``X.weight_scale``
is per tensor, per channel or per block (``strategy: "block"``, ``block_structure``). Which
tensors are quantized is read from the checkpoint: a weight with a scale beside it. Every other
method is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_overlap.core.errors import ConfigError, is_int

FP8 = "fp8"
QUANTIZATIONS = (FP8,)  # --quantization's choices
_FORMATS = ("e4m3", "float8_e4m3fn")
COMPRESSED_TENSORS = "compressed-tensors"
_FIXES = {
    "mxfp4": "for GPT-OSS: load it in transformers with Mxfp4Config(dequantize=True) and "
    "save_pretrained",
    "fbgemm_fp8": "convert it to the fp8 block layout or to bf16",
}
_SKIP_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore")  # the Hub's three spellings


@dataclass(frozen=True)
class Fp8Config:
    """An FP8 checkpoint's layout: ``block`` (rows, cols) of one scale, or None when each
    weight carries one scale per tensor or per output row (``weight_scale``)."""

    block: tuple[int, int] | None
    scale_suffix: str  # "weight_scale_inv" (block-wise) or "weight_scale"
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers, as written


def quant_config_of(raw: dict[str, Any], where: str) -> Fp8Config | None:
    """The FP8 layout of the checkpoint whose ``config.json`` is ``raw`` (None: not
    quantized); an unsupported method or a malformed FP8 config raises ``ConfigError``."""
    quant = raw.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    if method == COMPRESSED_TENSORS and isinstance(quant, dict):
        return _compressed_tensors(quant, where)
    if method != FP8 or not isinstance(quant, dict):
        fix = f" ({_FIXES[str(method)]})" if str(method) in _FIXES else ""
        raise ConfigError(
            f"{where}: config.json has quantization_config quant_method={method!r}; only "
            f"{FP8!r} (block, per-channel or per-tensor float8_e4m3fn) and "
            f"{COMPRESSED_TENSORS!r} (float-quantized) are supported. Load a bf16 checkpoint"
            f"{fix}, or plan with --hf-config and random weights"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt not in _FORMATS:
        raise ConfigError(f"{where}: FP8 fmt={fmt!r} is not supported; only e4m3 is")
    if quant.get("scale_fmt") not in (None, "float32", "bfloat16"):
        raise ConfigError(
            f"{where}: FP8 scale_fmt={quant['scale_fmt']!r} is not supported; only float scales"
        )
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Config(None, "weight_scale", _skipped(quant))
    return Fp8Config(_block(block, "weight_block_size", where), "weight_scale_inv", _skipped(quant))


def _compressed_tensors(quant: dict[str, Any], where: str) -> Fp8Config:
    """llm-compressor's layout: one config group of 8-bit float weights, each ``X.weight``
    beside ``X.weight_scale`` (per tensor, per channel or per block)."""
    groups = quant.get("config_groups") or {}
    groups = list(groups.values()) if isinstance(groups, dict) else [groups]  # any shape: named
    weights = groups[0].get("weights") if len(groups) == 1 and isinstance(groups[0], dict) else {}
    weights = weights if isinstance(weights, dict) else {}
    fmt, strategy = quant.get("format"), weights.get("strategy")
    fp8 = weights.get("type") == "float" and weights.get("num_bits") == 8
    if fmt != "float-quantized" or not fp8 or strategy not in ("tensor", "channel", "block"):
        raise ConfigError(
            f"{where}: config.json has quantization_config quant_method={COMPRESSED_TENSORS!r} "
            f"with format={fmt!r} and {len(groups)} config group(s) (weights "
            f"{weights.get('type')!r} {weights.get('num_bits')!r}-bit, strategy={strategy!r}); "
            "only one group of 8-bit float weights per tensor, channel or block "
            "(format float-quantized) is read. Load a bf16 checkpoint, or plan with --hf-config "
            "and random weights"
        )
    if strategy != "block":
        return Fp8Config(None, "weight_scale", _skipped(quant))
    block = _block(weights.get("block_structure"), "block_structure", where)
    return Fp8Config(block, "weight_scale", _skipped(quant))


def _skipped(quant: dict[str, Any]) -> tuple[str, ...]:
    return tuple(name for key in _SKIP_KEYS for name in quant.get(key) or ())


def _block(block: Any, key: str, where: str) -> tuple[int, int]:
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(map(_positive, block))):
        raise ConfigError(f"{where}: {key}={block!r} must be two positive ints, e.g. [128, 128]")
    return int(block[0]), int(block[1])


def check_quantization(
    asked: str | None, quant: Fp8Config | None, where: str, seeded: bool = False
) -> None:
    """``--quantization``: implied by the checkpoint, and refused where it disagrees.
    ``seeded``: ``where`` is a config.json whose weights are seeded (never FP8)."""
    if asked is None or (asked == FP8 and quant is not None):
        return
    if asked not in QUANTIZATIONS:
        raise ConfigError(f"--quantization={asked!r} must be one of {', '.join(QUANTIZATIONS)}")
    has = (
        f"--hf-config {where} seeds its weights in the run dtype" if seeded else f"{where} has none"
    )
    raise ConfigError(
        f"--quantization {asked} needs an FP8 checkpoint, and {has} (online quantization of "
        "bf16 weights is not implemented): drop --quantization, or write an FP8 checkpoint "
        "with make-model --quantize fp8 and give it as --model"
    )


def _positive(value: Any) -> bool:
    return is_int(value) and value > 0
