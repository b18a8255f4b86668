"""FP8 weights: block quantization as the Hub's ``-FP8`` checkpoints store it, its
dequantization, and a weight kept resident in FP8 and dequantized at each use.

A weight ``W [N, K]`` with block ``(bn, bk)`` is ``q`` (``float8_e4m3fn``) and a scale grid
``[ceil(N / bn), ceil(K / bk)]`` (the last blocks of a dimension that ``bn`` or ``bk`` does not
divide are short); ``W = q * scale`` element by element, in float32. Both paths here compute
exactly that product, so the once-at-load and the per-use weights are bit for bit the same."""

from __future__ import annotations

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a ``[N, K]`` weight cut in ``block`` (ceil-div: short last blocks)."""
    return -(-shape[-2] // block[0]), -(-shape[-1] // block[1])


def expand_scale(
    scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]
) -> torch.Tensor:
    """Each element's scale: the grid repeated over its blocks, cut to ``shape``."""
    rows = scale.float().repeat_interleave(block[0], dim=-2)[..., : shape[-2], :]
    return rows.repeat_interleave(block[1], dim=-1)[..., : shape[-1]]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q * scale`` per block, in float32."""
    return q.float() * expand_scale(scale, tuple(q.shape), block)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``scale = amax / 448`` per block (1 for a block of zeros), as the
    Hub's FP8 checkpoints are made."""
    n, k = weight.shape
    rows, cols = grid_shape((n, k), block)
    padded = weight.float().new_zeros(rows * block[0], cols * block[1])
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (weight.float() / expand_scale(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


class Fp8Dequant(nn.Module):
    """A parametrization (``torch.nn.utils.parametrize``): the module's weight is kept as FP8
    ``q [..., N, K]`` and rebuilt in ``dtype`` at each use from ``row_scale [..., N, C]``,
    one scale per row and column block of ``cols`` columns (a block grid repeated over its rows:
    rows cut by TP or EP need no block arithmetic)."""

    row_scale: torch.Tensor

    def __init__(self, row_scale: torch.Tensor, cols: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("row_scale", row_scale)
        self.cols, self.dtype = cols, dtype

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        k = q.shape[-1]
        if k % self.cols == 0:  # each block's columns times its scale, broadcast
            blocks = q.float().view(*q.shape[:-1], k // self.cols, self.cols)
            return (blocks * self.row_scale[..., None]).view(q.shape).to(self.dtype)
        scale = self.row_scale.repeat_interleave(self.cols, dim=-1)[..., :k]
        return (q.float() * scale).to(self.dtype)

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight  # the FP8 tensor is assigned as it is


def resident_bytes(module: nn.Module) -> tuple[int, int]:
    """(bytes of the FP8 weights and their scales, bytes the same weights take in bf16)."""
    held = bf16 = 0
    for sub in module.modules():
        if isinstance(sub, Fp8Dequant):
            held += sub.row_scale.numel() * sub.row_scale.element_size()
        for param in sub.parameters(recurse=False):
            if param.dtype == FP8_DTYPE:
                held += param.numel()
                bf16 += 2 * param.numel()
    return held, bf16
