"""A bank of FP8 experts as one W8A8 launch per projection (a Triton kernel, as SGLang's and
vLLM's fused MoE run block FP8), in place of one ``F.scaled_mm`` per expert.

torch has no grouped GEMM with 128x128 block scales (``F.scaled_grouped_mm`` takes tensor- and
row-wise scales on sm90), and a GEMM per expert is sized on the host: a launch and a host
count per expert, and no CUDA graph. This one reads the experts' row ends on the device, so the
low-latency dispatch and the decode graphs keep it, and reads an expert's FP8 weights once per
64-row tile of its rows (once, at decode's few rows per expert).

The activations are quantized per token in groups of 128 (``scale = amax / 448``, the linears'
W8A8 rule, ``fp8_scale_layout.quantize_activations``), or come quantized so already: the FP8
dispatch's rows, as they arrived (``grouped_fp8_rows``). Each output row depends on its own row
only, so a row gets the same bits whichever micro-batch or SBO block it runs in.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from moe_overlap.dispatch.fp8_rows import dequantize as dequantize_rows
from moe_overlap.model.fp8_scale_layout import quantize_activations
from moe_overlap.model.fp8_weights import dequantize


@functools.cache
def kernel() -> ModuleType | None:
    """``fp8_grouped_kernel`` (Triton), imported on first use; None without Triton."""
    try:
        import moe_overlap.model.fp8_grouped_kernel as module
    except ImportError:
        return None
    return module


BLOCK_M = 64  # rows per tile, fixed: a row's bits must not depend on how many rows came
BLOCK_N = 128  # output columns per tile: one weight scale block
GROUP_K = 128  # the scales' group along K


def tile_map(ends: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tile of ``rows`` rows grouped by expert (``ceil(rows / BLOCK_M)`` plus one
    per expert: at least every expert's ``ceil(its rows / BLOCK_M)``), its expert
    (``len(ends)`` past the last) and first row, from the device's row ends."""
    tiles = -(-rows // BLOCK_M) + len(ends)
    counts = torch.diff(ends.long(), prepend=ends.new_zeros(1, dtype=torch.long))
    per_expert = (counts + BLOCK_M - 1) // BLOCK_M
    last = per_expert.cumsum(0)
    tile = torch.arange(tiles, device=ends.device)
    expert = torch.searchsorted(last, tile, right=True)
    e = expert.clamp(max=len(ends) - 1)
    row = (ends.long() - counts)[e] + (tile - (last - per_expert)[e]) * BLOCK_M
    return expert.int(), row.int()


def grouped_fp8(
    x: torch.Tensor,
    ends: torch.Tensor,
    q: torch.Tensor,
    grid: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [M, K]`` (rows grouped by expert; expert e's end at ``ends[e]``, int32 on the
    device) times each expert's ``(q * grid)^T``: ``q [E, N, K]`` FP8, ``grid [E, N / 128,
    >= K / 128]``; ``[M, N]`` in x's dtype. ``tiles``: ``tile_map(ends, M)`` where the caller
    has it (a bank's two projections share it). Raises where Triton is absent."""
    if x.shape[0] == 0:
        return x.new_empty(0, q.shape[1])
    return grouped_fp8_rows(*quantize_activations(x), x.dtype, ends, q, grid, tiles)


def grouped_fp8_rows(
    xq: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
    ends: torch.Tensor,
    q: torch.Tensor,
    grid: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``grouped_fp8`` of rows already quantized: ``xq [M, K]`` FP8 (each row's values
    contiguous, rows any distance apart) and its scales ``scale [M, K / 128]`` (any strides),
    such as the FP8 dispatch's rows as they arrived; the output in ``dtype``."""
    module = kernel()
    if module is None:
        raise NotImplementedError("Triton is not installed: no grouped FP8 kernel")
    m, k = xq.shape
    experts, n, _ = q.shape
    if q.stride(-1) != 1 or q.stride(-2) != k or k % GROUP_K or xq.stride(-1) != 1:
        raise ValueError(
            f"FP8 experts {tuple(q.shape)} and rows {tuple(xq.shape)} must be row-major, "
            "with K % 128 == 0"
        )
    out = xq.new_empty((m, n), dtype=dtype)
    if m == 0:
        return out
    tile_expert, tile_row = tile_map(ends, m) if tiles is None else tiles
    module.grouped[(tile_expert.numel(), -(-n // BLOCK_N))](
        xq,
        scale,
        q,
        grid,
        out,
        tile_expert,
        tile_row,
        ends,
        n,
        k,
        xq.stride(0),
        scale.stride(0),
        scale.stride(1),
        q.stride(0),
        grid.stride(0),
        grid.stride(1),
        experts,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        GROUP_K=GROUP_K,
    )
    return out


def reference(
    x: torch.Tensor, ends: list[int], q: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """What ``grouped_fp8`` computes, in torch: the quantized activations, dequantized, times
    each expert's dequantized weight (fp32); for the checks and the tests."""
    rows = dequantize_rows(*quantize_activations(x), GROUP_K)
    out = torch.zeros(x.shape[0], q.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(ends):
        weight = dequantize(q[e], grid[e, :, : q.shape[2] // GROUP_K], (128, 128))
        out[start:end] = rows[start:end] @ weight.float().t()
        start = end
    return out


@functools.cache
def grouped_works(device: torch.device) -> bool:
    """Whether the engine runs its FP8 experts through ``grouped_fp8`` on ``device``: a GPU
    where the kernel checks out (``kernel_matches``), checked once; never on CPU, where the
    kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``), for the tests."""
    return device.type == "cuda" and kernel_matches(device)


def kernel_matches(device: torch.device) -> bool:
    """Whether ``grouped_fp8`` runs on ``device`` and matches ``reference`` on three experts
    of 5, 0 and 70 rows (a tile cut, an empty expert, K = 768, N = 256)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(3, 256, 768, generator=gen).to(device, torch.float8_e4m3fn)
    grid = torch.rand(3, 2, 6, generator=gen).add(0.5).to(device)
    x = torch.randn(75, 768, generator=gen).to(device, torch.bfloat16)
    ends = [5, 5, 75]
    try:
        y = grouped_fp8(x, torch.tensor(ends, dtype=torch.int32, device=device), q, grid)
    except (RuntimeError, ValueError, NotImplementedError, ImportError):
        return False
    expected = reference(x, ends, q, grid)
    return ((y.float() - expected).norm() / expected.norm()).item() < 0.02
