"""Weights: load a Hub-layout safetensors checkpoint (each rank reads only its shard), build
seeded random weights, and save a checkpoint that ``transformers`` can read back."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_overlap.core.errors import CheckpointError
from moe_overlap.core.hf_config import read_json
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.checkpoint_layout import (
    Entry,
    checkpoint_layout,
    fill,
    full_shape,
    layout_entries,
)
from moe_overlap.model.fp8_checkpoint import read_fp8
from moe_overlap.model.fp8_resident import (
    Fp8Loaded,
    fill_resident,
    keeps_fp8,
    make_resident,
    settle_fp8,
)
from moe_overlap.model.fp8_weights import FP8_DTYPE
from moe_overlap.model.fused_experts import FusedExperts
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.quant_config import Fp8Config, quant_config_of
from moe_overlap.model.rope import RotaryEmbedding
from moe_overlap.model.router import Router
from moe_overlap.model.skeleton import materialize, skeleton
from moe_overlap.model.tensor_parallel import ModelParallel

__all__ = ["CheckpointError", "checkpoint_layout"]


def load_checkpoint(
    model: MoeForCausalLM,
    path: str | Path,
    progress: bool = False,
    keep_fp8: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Fp8Loaded:
    """Fill ``model`` from ``path/*.safetensors`` one tensor at a time; read only the tensors
    this rank owns. Parameters still on ``meta`` (``skeleton``) are allocated first, in
    ``dtype`` (``materialize``). ``progress``: a bar on stderr while it reads, where stderr is a
    terminal. An FP8 checkpoint's weights are dequantized into the parameters (float32,
    ``q * scale`` per block, cast once), or (``keep_fp8``) the parameters become FP8 tensors
    filled as stored, their scales returned for ``keep_resident``."""
    path = Path(path)
    quant = (
        quant_config_of(read_json(path), str(path)) if (path / "config.json").is_file() else None
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    where = _index(files)
    loaded = Fp8Loaded()
    if keep_fp8 and quant is not None:
        loaded.resident = make_resident(model, _fp8_columns(model, where, quant))
    materialize(model, dtype)
    entries = layout_entries(model)
    _check_mtp(model, entries, where, path)
    scales = iter(layout_entries(model, {p: r.row_scale for p, r in loaded.resident.items()}))
    console = Console(stderr=True)
    pairs = track(
        [(e, next(scales) if e.param in loaded.resident else None) for e in entries],
        description=f"loading {path.name}",
        disable=not (progress and console.is_terminal),  # nothing at all into a pipe or file
        transient=True,
        console=console,
    )
    with torch.no_grad():
        for entry, scale in pairs:
            _load_tensor(entry, scale, where, quant, loaded)
    return loaded


def _check_mtp(model: MoeForCausalLM, entries: list[Entry], where: dict, path: Path) -> None:
    """A checkpoint without the MTP layers its config declares loads for plain serving (they
    are built only for MTP drafts), and is refused, naming the first missing tensor, where they
    are asked for."""
    prefixes = tuple(f"model.layers.{layer.layer_id}." for layer in model.mtp_layers)
    missing = [
        e.name for e in entries if e.param.startswith(prefixes) and not _stored_name(e.name, where)
    ]
    if missing:
        raise CheckpointError(
            f"{path} lacks the MTP weights its config declares (num_nextn_predict_layers="
            f"{model.cfg.num_nextn_predict_layers}; {missing[0]!r} and {len(missing) - 1} more "
            "are missing), which MTP drafts (--speculative-algorithm EAGLE or NEXTN) need: use "
            "--speculative-algorithm NGRAM, or a checkpoint that carries them"
        )


def _load_tensor(
    entry: Entry, scale: Entry | None, where: dict[str, Path], quant, loaded: Fp8Loaded
) -> None:
    """Read checkpoint tensor ``entry.name`` and fill this rank's part of it; the tensor read
    is dropped on return."""
    name = entry.name
    stored = _stored_name(name, where)
    if stored is None:
        raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
    value = _read(name, stored, where[stored])
    expected = full_shape(entry.view, entry.shard)
    if tuple(value.shape) != expected:
        raise CheckpointError(
            f"tensor {name!r} in {where[stored].name} has shape {tuple(value.shape)}, "
            f"expected {expected} from config.json"
        )
    fp8 = read_fp8(name, stored, value, where, quant)
    if fp8 is None:
        fill(entry.view, entry.shard, value)
        return
    loaded.names.append(name)
    if scale is not None:  # kept in FP8: the bytes as stored
        fill_resident(entry, scale, fp8, loaded.resident[entry.param])
    else:
        fill(entry.view, entry.shard, fp8.dequantize())


def _fp8_columns(model: MoeForCausalLM, where: dict[str, Path], quant: Fp8Config) -> dict:
    """Each FP8 checkpoint tensor's column block (a scale beside it): the config's block, or
    a whole row for per-tensor and per-channel scales."""
    cols = {}
    for entry in layout_entries(model):
        stored = _stored_name(entry.name, where)
        if stored is not None and stored.removesuffix("weight") + quant.scale_suffix in where:
            whole = full_shape(entry.view, entry.shard)[-1]
            cols[entry.name] = quant.block[1] if quant.block else whole
    return cols


def _read(name: str, stored: str, file: Path) -> torch.Tensor:
    try:
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(stored)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}") from exc


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
        for entry in layout_entries(model):
            name, dest, shard = entry.name, entry.view, entry.shard
            shape = full_shape(dest, shard)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            if len(shape) >= 2:
                value = noise * shape[-1] ** -0.5
            elif name.endswith(("e_score_correction_bias", ".bias")) or entry.param in centred:
                value = 0.1 * noise
            else:  # norm weights (and Qwen3.5's per-head decay parameters)
                value = 1.0 + 0.1 * noise
            fill(dest, shard, value.to(dest.dtype))


def save_checkpoint(model: MoeForCausalLM, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the Hub layout (one process, all experts)."""
    layout = checkpoint_layout(model)
    if any(
        not shard.is_whole
        if isinstance(shard, FusedExperts)
        else shard is not None and dest.shape != full_shape(dest, shard)
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
    fp8_on_the_fly: bool = False,
    mtp: bool = False,
) -> MoeForCausalLM:
    """Build this rank's model and fill it from ``path`` (``progress``: with a bar, see
    ``load_checkpoint``; an FP8 checkpoint's weights are dequantized at load on CPU, kept in FP8
    on a GPU (W8A8 where it runs); ``fp8_on_the_fly``: kept in FP8 on CPU too, and dequantized
    at use rather than W8A8 on a GPU: ``model/fp8_resident.py``), or with seeded random weights, then
    move it to ``device`` in ``dtype`` (a checkpoint's parameters allocated in ``dtype`` and
    each filled from its tensor in float32, so a bf16 model holds exactly the fp32 model's
    weights rounded once, and a load's peak is the model plus one tensor). On ``meta`` the weights have shapes and no values:
    nothing is filled, and a full-size model takes no memory (``tools/device_ops.py``).
    ``mtp``: with the config's MTP layers (``model/mtp.py``)."""
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            model = MoeForCausalLM(cfg, par, mtp)
        return place_model(model, device, dtype).eval()
    if path is None:
        model = MoeForCausalLM(cfg, par, mtp)
        init_random(model, seed)
        return place_model(model, device, dtype).eval()
    model = skeleton(cfg, par, mtp)  # each parameter allocated once, in dtype, as it is read
    keep = keeps_fp8(device, fp8_on_the_fly)
    loaded = load_checkpoint(model, path, progress, keep_fp8=keep, dtype=dtype)
    place_model(model, device, dtype)
    if loaded.names:
        settle_fp8(model, loaded, dtype, on_the_fly=fp8_on_the_fly, report=progress)
    return model.eval()


def place_model(model: MoeForCausalLM, device: torch.device | str, dtype: torch.dtype):
    """Move ``model`` to ``device`` and cast its weights to ``dtype``, except the routers
    (the routing decision stays in float32, as SGLang keeps the correction bias) and RoPE's
    frequencies."""
    model.to(device)
    for module in model.modules():
        if isinstance(module, Router | RotaryEmbedding):
            continue
        for param in module.parameters(recurse=False):
            if param.dtype == FP8_DTYPE:  # an FP8 weight kept resident: dequantized at use
                continue
            param.data = param.data.to(dtype)  # in place: tied weights stay tied
    return model


def model_placement(model: MoeForCausalLM) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``model``'s activations (and so of its KV cache)."""
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    return norm.weight.device, norm.weight.dtype
