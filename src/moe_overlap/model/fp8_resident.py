"""An FP8 checkpoint's weights after load: dequantized once into the run dtype (the default),
or kept resident in FP8 and dequantized at each use (``--fp8-dequant-on-the-fly``), and the
load log line that says which, with the bytes they hold.

Kept resident, a parameter becomes its FP8 tensor under ``Fp8Dequant`` (a parametrization),
with one scale per row and column block: rows cut by TP or EP keep their own scales; a column
cut (a ``RowLinear``'s or an expert's down projection under TP) must start on a block."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.nn.utils import parametrize

from moe_overlap.core.errors import ConfigError
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.checkpoint_layout import Entry, fill, layout_entries
from moe_overlap.model.fp8_checkpoint import Fp8Tensor
from moe_overlap.model.fp8_scale_layout import gemm_works
from moe_overlap.model.fp8_w8a8 import (
    W8A8_BLOCK,
    W8A8Experts,
    W8A8Linear,
    experts_fit,
    w8a8_available,
    w8a8_fits,
)
from moe_overlap.model.fp8_weights import FP8_DTYPE, Fp8Dequant, resident_bytes
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.quant_config import Fp8Config
from moe_overlap.model.tensor_parallel import Shard

log = logging.getLogger(__name__)
_MIB = 2**20


def keeps_fp8(device: torch.device | str, on_the_fly: bool) -> bool:
    """Whether an FP8 checkpoint's weights stay resident in FP8: on a GPU always (W8A8, or
    dequantized at use), on CPU with ``--fp8-dequant-on-the-fly``."""
    return on_the_fly or torch.device(device).type == "cuda"


def fp8_path(quant: Fp8Config | None, device: torch.device | str, on_the_fly: bool) -> str | None:
    """Which path an FP8 checkpoint's linears take (None: not FP8), as the bench prints it."""
    if quant is None:
        return None
    if not keeps_fp8(device, on_the_fly):
        return "FP8 weights dequantized once at load (CPU has no FP8 matmul)"
    if not on_the_fly and w8a8_available(device) and quant.block == W8A8_BLOCK:
        return (
            "FP8 weights resident; W8A8 block FP8 on the linears (F.scaled_mm) and expert banks "
            "that fit (a Triton launch per projection where Triton runs, else F.scaled_mm per "
            "expert), the rest dequantized at each use"
        )
    return "FP8 weights resident, dequantized at each use (no W8A8 here)"


def settle_fp8(
    model: MoeForCausalLM,
    loaded: Fp8Loaded,
    dtype: torch.dtype,
    on_the_fly: bool,
    report: bool,
) -> None:
    """Keep the FP8 weights resident where ``keeps_fp8`` says so, with W8A8 where it runs, and
    log (``report``) which, with the bytes they hold against bf16."""
    names = set(loaded.names)
    elements = sum(e.view.numel() for e in layout_entries(model) if e.name in names)
    device = next(model.parameters()).device
    how = f"dequantized once at load to {str(dtype).removeprefix('torch.')} (no FP8 matmul on CPU)"
    held, bf16 = elements * dtype.itemsize, 2 * elements
    if loaded.resident:
        w8a8 = not on_the_fly and w8a8_available(device)
        scaled = keep_resident(model, loaded.resident, dtype, w8a8)
        held, bf16 = resident_bytes(model)
        how = "kept in FP8 and dequantized at each use"
        if scaled:
            kernels = expert_kernels(model)
            detail = f"; {kernels}" if kernels else ""
            how = f"kept in FP8 ({scaled} linears and expert banks W8A8, the rest dequantized{detail})"
    if report:
        log.info(
            "FP8 checkpoint: %d quantized weights %s; resident %.2f MiB (weights plus scales), "
            "%.2f MiB in bf16 (%.2fx)",
            len(names),
            how,
            held / _MIB,
            bf16 / _MIB,
            held / bf16 if bf16 else 0.0,
        )


@dataclass
class ResidentFp8:
    """A parameter kept in FP8: the tensor the module holds from the load on, its scales per
    row and ``cols`` columns, where its shard starts, and its checkpoint block (set as it is
    filled)."""

    q: torch.Tensor
    row_scale: torch.Tensor
    cols: int
    starts: tuple[int, int]
    block: tuple[int, int] | None = None


@dataclass
class Fp8Loaded:
    """What a load found FP8: the checkpoint names, and the parameters it kept in FP8."""

    names: list[str] = field(default_factory=list)
    resident: dict[str, ResidentFp8] = field(default_factory=dict)


def make_resident(model: MoeForCausalLM, cols: Mapping[str, int]) -> dict[str, ResidentFp8]:
    """Before the load: each parameter whose every checkpoint tensor is FP8 (``cols``: each
    FP8 tensor's column block) becomes an unfilled FP8 tensor with its scales, so no run-dtype
    copy of it is ever made."""
    by_param: dict[str, list[Entry]] = defaultdict(list)
    for entry in layout_entries(model):
        by_param[entry.param].append(entry)
    resident = {}
    for param, entries in by_param.items():
        block = column_block(entries, cols)
        if block is None:
            continue
        weight = model.get_parameter(param)
        shape = (*weight.shape[:-1], -(-weight.shape[-1] // block))
        held = ResidentFp8(
            torch.empty(weight.shape, dtype=FP8_DTYPE),
            torch.empty(shape, dtype=torch.float32),
            block,
            _starts(entries[0].shard),
        )
        owner, _, attr = param.rpartition(".")
        kept = nn.Parameter(held.q, requires_grad=False)
        kept.__dict__.update(weight.__dict__)  # its Shard tag
        model.get_submodule(owner)._parameters[attr] = kept
        resident[param] = held
    return resident


def fill_resident(q: Entry, scale: Entry, tensor: Fp8Tensor, held: ResidentFp8) -> None:
    """Copy checkpoint tensor ``tensor``'s part into the FP8 parameter (``q``: its view there)
    and its scales (``scale``: their view), as stored."""
    fill(q.view, q.shard, tensor.q)
    _fill_scale(scale, tensor)
    held.block = tensor.block


def keep_resident(
    model: MoeForCausalLM, resident: dict[str, ResidentFp8], dtype: torch.dtype, w8a8: bool = False
) -> int:
    """Rebuild each FP8 parameter in ``dtype`` at each use, bit for bit the weight the default
    load holds. ``w8a8``: linears that fit run the scaled FP8 GEMM instead
    (``model/fp8_w8a8.py``); returns how many."""
    scaled = 0
    for param, held in resident.items():
        owner, _, attr = param.rpartition(".")
        module = model.get_submodule(owner)
        held.q = q = getattr(module, attr)  # moved with the model
        held.row_scale = scale = held.row_scale.to(q.device)
        parametrize.register_parametrization(
            module, attr, Fp8Dequant(scale, held.cols, dtype), unsafe=True
        )
        block = held.block
        if w8a8 and hasattr(module, "w8a8") and block and w8a8_fits(q, block, held.starts):
            rebuild = partial(getattr, module, attr)  # the fallback: dequantized at use
            module.w8a8 = W8A8Linear(q, scale[:: block[0]], rebuild)
            scaled += 1
    scaled += _w8a8_experts(model, resident) if w8a8 else 0
    if scaled:  # the GEMM checked now, never inside a CUDA graph's capture
        gemm_works(next(iter(resident.values())).q.device)
    return scaled


def expert_kernels(model: nn.Module) -> str | None:
    """How the W8A8 expert banks run, as the load log and the bench's header say it (None
    where no bank runs W8A8: the CPU, or FP8 linears only)."""
    banks = [m.w8a8 for m in model.modules() if isinstance(m, ExpertBank) and m.w8a8]
    if not banks:
        return None
    grouped = sum(1 for b in banks if b.grouped and not b.failed)
    return (
        f"{grouped} of {len(banks)} W8A8 expert banks as one Triton launch per projection, "
        "the rest one F.scaled_mm per expert (dequantized where that failed)"
    )


def _w8a8_experts(model: MoeForCausalLM, resident: dict[str, ResidentFp8]) -> int:
    """Give each expert bank whose both projections are FP8 and fit 128x128 blocks its
    per-expert scaled GEMMs; returns how many."""
    banks = 0
    for name, bank in model.named_modules():
        if not isinstance(bank, ExpertBank) or bank.swiglu is not None:
            continue
        held = [resident.get(f"{name}.{attr}") for attr in ("gate_up_proj", "down_proj")]
        gate_up, down = held
        if gate_up is None or down is None or gate_up.block != down.block:
            continue
        hidden = down.q.shape[1]  # not bank.down_proj: that would dequantize the bank
        if experts_fit(hidden, bank.intermediate, bank.inter_start, gate_up.block):
            bank.w8a8 = W8A8Experts(_with_grid(gate_up), _with_grid(down))
            banks += 1
    return banks


def _with_grid(held: ResidentFp8) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 expert projection and its 128x128 grid per expert (``[E, N / 128, K / 128]``)."""
    return held.q, held.row_scale[:, ::128].contiguous()


def _starts(shard: object) -> tuple[int, int]:
    """Where a 2-D weight's shard starts in the checkpoint tensor (rows, columns)."""
    if not isinstance(shard, Shard):
        return 0, 0
    return (shard.start, 0) if shard.dim == 0 else (0, shard.start)


def column_block(entries: list[Entry], cols: Mapping[str, int]) -> int | None:
    """The column block every checkpoint tensor of one parameter shares (``cols``: each FP8
    checkpoint tensor's; None: the parameter is not all FP8, or its tensors differ); refuses a
    column shard that cuts a block."""
    if not all(e.name in cols and isinstance(e.shard, Shard | None) for e in entries):
        return None
    blocks = {cols[e.name] for e in entries}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    for e in entries:
        if isinstance(e.shard, Shard) and e.shard.dim == 1 and e.shard.start % block:
            raise ConfigError(
                f"--fp8-dequant-on-the-fly: {e.name}'s shard starts at column {e.shard.start}, "
                f"inside a scale block of {block} columns; drop --fp8-dequant-on-the-fly (the "
                "default dequantizes at load and cuts any shard) or choose a --tp that cuts "
                "on block boundaries"
            )
    return block


def _fill_scale(entry: Entry, tensor: Fp8Tensor) -> None:
    rows = tensor.row_scale()  # [N, column blocks]: a row cut takes its rows' scales
    shard = entry.shard
    if isinstance(shard, Shard) and shard.dim == 1:  # starts on a block (column_block)
        cols = tensor.block[1]
        shard = Shard(1, shard.start // cols, rows.shape[1])
    fill(entry.view, shard, rows)
