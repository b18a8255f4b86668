"""FP8 checkpoints in the Hub's layout: which tensors ``make-model --quantize fp8`` quantizes,
writing them, and reading one quantized tensor back with its scales checked.

Quantized, as in the Hub's ``-FP8`` checkpoints: the 2-D projection weights of attention, linear
attention and every MLP and expert (``*_proj``). Left in the run dtype: embeddings, the LM head,
norms, routers (``mlp.gate``), Qwen3.5's ``shared_expert_gate``, convolutions, biases, and per
family what its Hub checkpoint lists: Qwen3.5's linear attention ``in_proj_a``/``in_proj_b``
(``modules_to_not_convert``), MiMo-V2-Flash's every ``self_attn.o_proj`` (``ignored_layers``).
GLM-4.5 is written as llm-compressor's ``compressed-tensors`` export (``X.weight_scale``, block
strategy), the others as ``quant_method: fp8`` (``X.weight_scale_inv``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_overlap.core.errors import CheckpointError
from moe_overlap.model.fp8_weights import FP8_DTYPE, dequantize, grid_shape, quantize
from moe_overlap.model.quant_config import COMPRESSED_TENSORS, FP8, Fp8Config

LINEAR_ATTN_SKIPPED = ("linear_attn.in_proj_a", "linear_attn.in_proj_b")  # Qwen3.5's, small
_SKIPPED_BY_FAMILY = {"mimo_v2_flash": ("self_attn.o_proj",)}  # model_type -> its Hub's list
_COMPRESSED_FAMILIES = ("glm4_moe",)  # written as llm-compressor's float-quantized export


@dataclass
class Fp8Tensor:
    """One checkpoint weight as stored: ``q`` and its scale ``grid``, one scale per ``block``
    (a per-tensor scale is one block of the whole tensor; a per-channel one, blocks of a row)."""

    q: torch.Tensor
    grid: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.grid, self.block)

    def row_scale(self) -> torch.Tensor:
        """The grid repeated over each block's rows: ``[N, column blocks]``."""
        return self.grid.float().repeat_interleave(self.block[0], dim=0)[: self.q.shape[0]]


def _skipped(module: str, skipped: tuple[str, ...]) -> bool:
    return any(module.endswith(f".{name}") for name in skipped)


def is_quantized_name(
    name: str, tensor: torch.Tensor, skipped: tuple[str, ...] = LINEAR_ATTN_SKIPPED
) -> bool:
    """Whether ``make-model --quantize fp8`` stores checkpoint tensor ``name`` in FP8
    (``skipped``: module-name suffixes the family's Hub checkpoint leaves unquantized)."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    return (
        leaf == "weight"
        and tensor.dim() == 2
        and tensor.is_floating_point()
        and "proj" in last
        and not _skipped(module, skipped)
    )


def quantize_checkpoint(path: str | Path, block: tuple[int, int]) -> int:
    """Rewrite the bf16/fp32 checkpoint in ``path`` (one ``model.safetensors``) as block FP8 in
    its family's Hub layout, with ``quantization_config`` in its ``config.json``; returns how
    many tensors it quantized."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    family = raw.get("model_type")
    skipped = LINEAR_ATTN_SKIPPED + _SKIPPED_BY_FAMILY.get(family, ())
    suffix = "_scale" if family in _COMPRESSED_FAMILIES else "_scale_inv"
    tensors = load_file(str(path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not is_quantized_name(name, tensor, skipped):
            out[name] = tensor
            continue
        out[name], out[f"{name}{suffix}"] = quantize(tensor, block)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    left = sorted({m for n in tensors if _skipped(m := n.rpartition(".")[0], skipped)})
    raw["quantization_config"] = _hub_config(family, block, left)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return sum(t.dtype == FP8_DTYPE for t in out.values())


def _hub_config(family: str | None, block: tuple[int, int], left: list[str]) -> dict:
    """The ``quantization_config`` a family's Hub FP8 checkpoint carries; ``left``: the modules
    left unquantized beyond the routers, norms and embeddings."""
    if family in _COMPRESSED_FAMILIES:  # llm-compressor's FP8_BLOCK preset
        fp8 = {"type": "float", "num_bits": 8, "symmetric": True}
        weights = fp8 | {"strategy": "block", "block_structure": list(block), "dynamic": False}
        inputs = fp8 | {"strategy": "group", "group_size": block[1], "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        return {
            "quant_method": COMPRESSED_TENSORS,
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head", "re:.*mlp.gate$"],
        }
    config = {
        "quant_method": FP8,
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    if family in _SKIPPED_BY_FAMILY:
        return config | {"ignored_layers": left}  # MiMo-V2-Flash's: full module names
    if left:
        return config | {"modules_to_not_convert": list(LINEAR_ATTN_SKIPPED)}
    return config


def read_fp8(
    name: str, stored: str, value: torch.Tensor, where: dict[str, Path], quant: Fp8Config | None
) -> Fp8Tensor | None:
    """Checkpoint tensor ``stored`` (our ``name``), read as ``value``, with its scales when it
    is FP8 (None when it is stored unquantized). A missing scale or a scale grid that does not
    fit the weight raises ``CheckpointError`` naming both, as does an 8-bit float tensor in a
    checkpoint whose config has no ``quantization_config`` (its scales would go unread)."""
    if quant is None:
        if value.is_floating_point() and value.element_size() == 1:
            raise CheckpointError(
                f"tensor {name!r} is {value.dtype}, but config.json has no quantization_config, "
                "so its scales would be ignored: restore the checkpoint's quantization_config "
                '(e.g. {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})'
            )
        return None
    scale_name = stored.removesuffix("weight") + quant.scale_suffix
    if scale_name not in where:
        if value.dtype == FP8_DTYPE:
            raise CheckpointError(
                f"tensor {name!r} is float8_e4m3fn but its scale {scale_name!r} is missing "
                f"from the checkpoint (quantization_config asks for {quant.scale_suffix})"
            )
        return None
    with safe_open(where[scale_name], framework="pt") as f:
        scale = f.get_tensor(scale_name)
    if value.dtype != FP8_DTYPE or value.dim() != 2:
        raise CheckpointError(
            f"tensor {name!r} has a scale {scale_name!r} but is {value.dtype} of shape "
            f"{tuple(value.shape)}: only 2-D float8_e4m3fn weights are read with scales"
        )
    n, k = value.shape
    if quant.block is not None:
        expected = grid_shape((n, k), quant.block)
        if tuple(scale.shape) != expected:
            raise CheckpointError(
                f"scale {scale_name!r} has shape {tuple(scale.shape)}; weight {name!r} of shape "
                f"{(n, k)} in blocks of {list(quant.block)} needs {expected} (ceil-div)"
            )
        return Fp8Tensor(value, scale, quant.block)
    if scale.numel() == 1:  # per tensor
        return Fp8Tensor(value, scale.reshape(1, 1), (n, k))
    if tuple(scale.shape) in ((n,), (n, 1)):  # per output channel
        return Fp8Tensor(value, scale.reshape(n, 1), (1, k))
    raise CheckpointError(
        f"scale {scale_name!r} has shape {tuple(scale.shape)}; weight {name!r} of shape "
        f"{(n, k)} needs one scale per tensor ([] or [1]) or per row ([{n}] or [{n}, 1])"
    )
