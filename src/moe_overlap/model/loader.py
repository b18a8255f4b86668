"""Weights: load a Hub-layout safetensors checkpoint (each rank reads only its shard), build
seeded random weights, and save a checkpoint that ``transformers`` can read back."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_overlap.core.hf_config import read_json, refuse_quantized
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.fused_experts import FusedExperts
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.rope import RotaryEmbedding
from moe_overlap.model.router import Router
from moe_overlap.model.tensor_parallel import ModelParallel, Shard

_EXPERT_PARAM = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")
_FUSED_PARAM = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
Slice = Shard | FusedExperts | None  # which part of the checkpoint tensor a tensor holds


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, holds one of the wrong shape, or is unreadable."""


def checkpoint_layout(model: MoeForCausalLM) -> dict[str, tuple[torch.Tensor, Slice]]:
    """Map each checkpoint tensor name this rank needs to the tensor (or view) it fills, and
    which slice of the checkpoint tensor that is (None: all of it)."""
    layout: dict[str, tuple[torch.Tensor, Slice]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            if model.is_first:
                continue  # the embedding's own tensor
            name = "model.embed_tokens.weight"  # a last stage without the embedding reads it
        if model.cfg.is_mimo:  # the Hub's name of its sinks
            name = name.replace(".self_attn.sinks", ".self_attn.attention_sink_bias")
        if model.cfg.is_gpt_oss:  # its router is mlp.router, its experts fused tensors
            name = name.replace(".mlp.gate.", ".mlp.router.")
            fused = _FUSED_PARAM.fullmatch(name)
            if fused is not None:
                bank = model.get_submodule(fused[1])
                assert isinstance(bank, ExpertBank), f"{fused[1]} is not an expert bank"
                where = FusedExperts.of(name.rsplit(".", 1)[1], bank, model.cfg.num_experts)
                layout[name] = (tensor.detach(), where)
                continue
        match = _EXPERT_PARAM.fullmatch(name)
        if match is None:
            layout[name] = (tensor.detach(), getattr(tensor, "shard", None))
            continue
        bank, prefix = model.get_submodule(match[1]), match[1]
        assert isinstance(bank, ExpertBank), f"{prefix} is not an expert bank"
        rows = Shard(0, bank.inter_start, bank.inter_full)  # gate and up: intermediate rows
        for i in range(bank.count):
            expert = f"{prefix}.{bank.logical[i]}"
            weights = tensor.detach()[i]
            if match[2] == "down_proj":
                cols = Shard(1, bank.inter_start, bank.inter_full)
                layout[f"{expert}.down_proj.weight"] = (weights, cols)
            else:  # the fused matrix: gate rows first, then up rows
                gate, up = weights.split(bank.intermediate)
                layout[f"{expert}.gate_proj.weight"] = (gate, rows)
                layout[f"{expert}.up_proj.weight"] = (up, rows)
    return layout


def _full_shape(dest: torch.Tensor, shard: Slice) -> tuple[int, ...]:
    return tuple(dest.shape) if shard is None else shard.full_shape(dest.shape)


def _fill(dest: torch.Tensor, shard: Slice, whole: torch.Tensor) -> None:
    dest.copy_(whole if shard is None else shard.take(whole, dest.shape))


def load_checkpoint(model: MoeForCausalLM, path: str | Path, progress: bool = False) -> None:
    """Fill ``model`` from ``path/*.safetensors``; read only the tensors this rank owns.
    ``progress``: a bar on stderr while it reads, where stderr is a terminal."""
    path = Path(path)
    if (path / "config.json").is_file():
        refuse_quantized(read_json(path), str(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    where = _index(files)
    layout = checkpoint_layout(model)
    console = Console(stderr=True)
    tensors = track(
        layout.items(),
        description=f"loading {path.name}",
        total=len(layout),
        disable=not (progress and console.is_terminal),  # nothing at all into a pipe or file
        transient=True,
        console=console,
    )
    with torch.no_grad():
        for name, (dest, shard) in tensors:
            stored = _stored_name(name, where)
            if stored is None:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path}")
            file = where[stored]
            try:
                with safe_open(file, framework="pt") as f:
                    value = f.get_tensor(stored)
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}") from exc
            expected = _full_shape(dest, shard)
            if tuple(value.shape) != expected:
                raise CheckpointError(
                    f"tensor {name!r} in {file.name} has shape {tuple(value.shape)}, "
                    f"expected {expected} from config.json"
                )
            _fill(dest, shard, value)


def _stored_name(name: str, where: dict[str, Path]) -> str | None:
    """The name ``name`` has in the checkpoint: itself, the LM head for an MTP layer's head
    the checkpoint leaves out, or (the Hub's multimodal Qwen3.5 checkpoints) under
    ``model.language_model.``."""
    if name in where:
        return name
    if name.endswith(".shared_head.head.weight") and "lm_head.weight" in where:
        return "lm_head.weight"  # an MTP layer without a head of its own shares the LM head's
    if name.startswith("model."):
        nested = "model.language_model." + name.removeprefix("model.")
        if nested in where:
            return nested
    return None


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

    Every tensor depends only on ``(seed, name)`` and is drawn whole, then cut to this rank's
    slice, so a rank holding experts 4..7 (or half of every head) gets exactly the weights a
    single process holding all of them has.
    """
    centred = {  # zero-centred norms store the scale's difference from 1
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, RMSNorm) and m.offset
    }
    with torch.no_grad():
        for name, (dest, shard) in checkpoint_layout(model).items():
            shape = _full_shape(dest, shard)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            if len(shape) >= 2:
                value = noise * shape[-1] ** -0.5
            elif name.endswith(("e_score_correction_bias", ".bias")) or name in centred:
                value = 0.1 * noise
            else:  # norm weights (and Qwen3.5's per-head decay parameters)
                value = 1.0 + 0.1 * noise
            _fill(dest, shard, value.to(dest.dtype))


def save_checkpoint(model: MoeForCausalLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the Hub layout (one process, all experts)."""
    layout = checkpoint_layout(model)
    if any(
        not shard.is_whole
        if isinstance(shard, FusedExperts)
        else shard is not None and dest.shape != _full_shape(dest, shard)
        for dest, shard in layout.values()
    ):
        raise ValueError("save_checkpoint needs the whole model (one process), not a rank's shard")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (shard.whole(dest) if isinstance(shard, FusedExperts) else dest).contiguous().clone()
        for k, (dest, shard) in layout.items()
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))


def build_model(
    cfg: ModelConfig,
    path: str | Path | None = None,
    seed: int = 0,
    par: ModelParallel | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    mtp: bool = False,
) -> MoeForCausalLM:
    """Build this rank's model and fill it from ``path`` (``progress``: with a bar, see
    ``load_checkpoint``), or with seeded random weights, then
    move it to ``device`` in ``dtype`` (filled in float32 first, so a bf16 model holds exactly
    the fp32 model's weights rounded once). On ``meta`` the weights have shapes and no values:
    nothing is filled, and a full-size model takes no memory (``tools/device_ops.py``).
    ``mtp``: with the config's MTP layers (``model/mtp.py``)."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = MoeForCausalLM(cfg, par, mtp)
        return place_model(model, device, dtype).eval()
    model = MoeForCausalLM(cfg, par, mtp)
    if path is None:
        init_random(model, seed)
    else:
        load_checkpoint(model, path, progress)
    return place_model(model, device, dtype).eval()


def place_model(model: MoeForCausalLM, device: torch.device | str, dtype: torch.dtype):
    """Move ``model`` to ``device`` and cast its weights to ``dtype``, except the routers
    (the routing decision stays in float32, as SGLang keeps the correction bias) and RoPE's
    frequencies."""
    model.to(device)
    for module in model.modules():
        if isinstance(module, Router | RotaryEmbedding):
            continue
        for param in module.parameters(recurse=False):
            param.data = param.data.to(dtype)  # in place: tied weights stay tied
    return model


def model_placement(model: MoeForCausalLM) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``model``'s activations (and so of its KV cache)."""
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    return norm.weight.device, norm.weight.dtype
