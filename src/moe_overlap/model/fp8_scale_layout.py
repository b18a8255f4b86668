"""The block-scaled FP8 GEMM as cuBLAS takes it: ``torch.nn.functional.scaled_mm`` with the
1x128 and 128x128 recipes named, and its scales laid out as cuBLAS reads them.

What an H200 (torch 2.11, CUDA 13) showed (``scripts/fp8_layout_probe.py``):
- ``torch._scaled_mm`` infers the recipes from the scales' shapes and takes the weight grid as
  ``[K/128, N/128]``; where K/128 is not a multiple of 4 (a Qwen3-30B-A3B down projection,
  K = 768) it was refused or, with 8 rows, ran and returned a wrong product (relative error 65):
  cuBLAS reads the grid with its column blocks padded to a multiple of 4.
- ``F.scaled_mm`` takes that padded grid, ``[K'/128, N/128]``, and gives the right product.
- Either refuses (``CUBLAS_STATUS_NOT_SUPPORTED``) activations whose row count is not a multiple
  of 4 (the 1x128 scales' leading dimension): a routed expert's few rows.

So the weight grids are padded once at load (``pad_grid``), the activation rows at each call,
and ``gemm_works`` checks once per device, on a GEMM with both misalignments, that the product
matches the dequantized one; where it does not (or torch lacks ``F.scaled_mm``), the callers
dequantize.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from moe_overlap.dispatch.fp8_rows import one_pass, quantize_into
from moe_overlap.dispatch.fp8_rows import quantize as quantize_rows
from moe_overlap.model.fp8_weights import FP8_DTYPE, dequantize, quantize

log = logging.getLogger(__name__)
ROW_MULTIPLE = 4  # activation rows per GEMM: a multiple of this
K_BLOCK_MULTIPLE = 4  # the weight grid's column blocks, padded in memory


def pad_grid(grid: torch.Tensor) -> torch.Tensor:
    """A weight grid ``[..., N/128, K/128]`` with its column blocks padded (with ones, which
    scale nothing: no weight column lies there) to a multiple of 4, contiguous."""
    return F.pad(grid, (0, -grid.shape[-1] % K_BLOCK_MULTIPLE), value=1.0).contiguous()


def quantize_activations(
    x: torch.Tensor, row_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128), its rows padded with zeros to a multiple of
    ``row_multiple``, as FP8 and its scales ``[M', K / 128]``, laid out column-major as
    cuBLAS's 1x128 scaling reads them. On a GPU where ``fp8_rows.one_pass`` holds, one Triton
    pass with the same bits; else the torch operations (about seven passes over the rows)."""
    if x.is_cuda and one_pass(x.device):
        return _quantize_in_one_pass(x, row_multiple)
    return _quantize_torch(x, row_multiple)


def _quantize_torch(x: torch.Tensor, row_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 dispatch's 1x128 quantization (``fp8_rows.quantize``: an all-zero group's
    scale is 0), its rows padded and its scales laid out for cuBLAS."""
    q, scale = quantize_rows(F.pad(x, (0, 0, 0, -x.shape[0] % row_multiple)), 128)
    return q, scale.t().contiguous().t()


def _quantize_in_one_pass(x: torch.Tensor, row_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_activations`` as one Triton launch (``fp8_rows.quantize_into``; the
    interpreter off a GPU, as the tests run it)."""
    m, k = x.shape
    rows = m + -m % row_multiple
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(k // 128, rows, dtype=torch.float32, device=x.device).t()
    quantize_into(x, q, scale)
    return q, scale


def scaled_mm(
    x: torch.Tensor, q: torch.Tensor, padded: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] (q * grid)^T (+ bias)``, ``[M, N]`` in x's dtype, as one ``F.scaled_mm``
    (the bias added after it: the probe never ran one inside); ``padded``: ``pad_grid``'s grid
    of ``q``."""
    xq, scale = quantize_activations(x, ROW_MULTIPLE)
    y = F.scaled_mm(  # keywords: as the probe called it on torch 2.11
        xq,
        q.t(),
        scale_a=scale,
        scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_b=padded.t(),
        scale_recipe_b=F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )
    y = y[: x.shape[0]]
    return y if bias is None else y + bias


@functools.cache
def gemm_works(device: torch.device) -> bool:
    """Whether ``scaled_mm`` runs on ``device`` and matches the dequantized product on 5 rows
    of K = 768 (both misalignments); never off a GPU."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm"):
        return False
    error = gemm_error(device, rows=5, n=256, k=768)
    if error is None or error > 0.05:
        log.warning("the block-scaled FP8 GEMM fails its check on %s (%s)", device, error)
        return False
    return True


def gemm_error(device: torch.device, rows: int, n: int, k: int) -> float | None:
    """``scaled_mm``'s relative error against the dequantized product; None where it raises."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(device, torch.bfloat16)
    q, grid = quantize(torch.randn(n, k, generator=gen).to(device), (128, 128))
    try:
        y = scaled_mm(x, q, pad_grid(grid)).float()
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        return None
    reference = x.float() @ dequantize(q, grid, (128, 128)).float().t()
    return ((y - reference).norm() / reference.norm()).item()
