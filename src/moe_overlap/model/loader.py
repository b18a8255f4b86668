"""Weights: load a Hub-layout safetensors checkpoint (each rank reads only its shard), build
seeded random weights, and save a checkpoint that ``transformers`` can read back."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.causal_lm import MoeForCausalLM

_EXPERT_PARAM = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, holds one of the wrong shape, or is unreadable."""


def checkpoint_layout(model: MoeForCausalLM) -> dict[str, torch.Tensor]:
    """Map each checkpoint tensor name this rank needs to the tensor (or view) it fills."""
    layout = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            continue
        match = _EXPERT_PARAM.fullmatch(name)
        if match is None:
            layout[name] = tensor
            continue
        bank, prefix = model.get_submodule(match[1]), match[1]
        for i in range(bank.count):
            expert = f"{prefix}.{bank.first + i}"
            if match[2] == "down_proj":
                layout[f"{expert}.down_proj.weight"] = tensor[i]
            else:  # the fused matrix: gate rows first, then up rows
                gate, up = tensor[i].split(bank.intermediate)
                layout[f"{expert}.gate_proj.weight"], layout[f"{expert}.up_proj.weight"] = gate, up
    return layout


def load_checkpoint(model: MoeForCausalLM, path: str | Path) -> None:
    """Fill ``model`` from ``path/*.safetensors``; read only the tensors this rank owns."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    where = _index(files)
    with torch.no_grad():
        for name, dest in checkpoint_layout(model).items():
            if name not in where:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path}")
            file = where[name]
            try:
                with safe_open(file, framework="pt") as f:
                    value = f.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}") from exc
            if tuple(value.shape) != tuple(dest.shape):
                raise CheckpointError(
                    f"tensor {name!r} in {file.name} has shape {tuple(value.shape)}, "
                    f"expected {tuple(dest.shape)} from config.json"
                )
            dest.copy_(value)


def _index(files: list[Path]) -> dict[str, Path]:
    where = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                where.update({key: file for key in f.keys()})  # noqa: SIM118 (not a dict)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
    return where


def init_random(model: MoeForCausalLM, seed: int) -> None:
    """Seeded random weights, drawn per checkpoint tensor name.

    Every tensor depends only on ``(seed, name)``, so a rank holding experts 4..7 gets the same
    expert weights as a single process holding all of them.
    """
    with torch.no_grad():
        for name, dest in checkpoint_layout(model).items():
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            noise = torch.randn(dest.shape, generator=gen, dtype=torch.float32)
            if dest.dim() >= 2:
                value = noise * dest.shape[-1] ** -0.5
            elif name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            else:  # norm weights
                value = 1.0 + 0.1 * noise
            dest.copy_(value.to(dest.dtype))


def save_checkpoint(model: MoeForCausalLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the Hub layout (one process, all experts)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in checkpoint_layout(model).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))


def build_model(
    cfg: ModelConfig,
    path: str | Path | None = None,
    seed: int = 0,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> MoeForCausalLM:
    """Build this rank's model and fill it from ``path``, or with seeded random weights."""
    model = MoeForCausalLM(cfg, ep_rank, ep_size)
    if path is None:
        init_random(model, seed)
    else:
        load_checkpoint(model, path)
    return model.eval()
