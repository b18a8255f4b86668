"""W8A8 block FP8 on a GPU: a linear's FP8 weight times its input quantized per token in
groups of 128 (``scale = amax / 448``, as SGLang and vLLM do), as one ``torch._scaled_mm``
with block scales (the input 1x128, the weight 128x128; cuBLAS on sm90 and later).

Taken only on CUDA with compute capability 9.0 or more, a torch that has ``_scaled_mm``, a
checkpoint in 128x128 blocks, and a shard that starts on a block; everything else (CPU
always, the experts, the MLA's plain ``nn.Linear`` down-projections) runs the dequantized
weight. A GEMM that raises at its first call falls back to the dequantized weight for good."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from moe_overlap.model.fp8_weights import FP8_DTYPE, FP8_MAX

W8A8_BLOCK = (128, 128)
log = logging.getLogger(__name__)


def w8a8_available(device: torch.device | str) -> bool:
    """Whether ``device`` runs block-scaled FP8 GEMMs (never on CPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and hasattr(torch, "_scaled_mm")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128) as FP8 and its scales ``[M, K / 128]``, laid out
    column-major as cuBLAS's 1x128 scaling reads them."""
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    return q, scale.t().contiguous().t()


class W8A8Linear(nn.Module):
    """``x W^T (+ bias)`` with ``W = q * grid`` in 128x128 blocks, as one scaled GEMM; ``dequantized``
    gives the weight for the fallback."""

    grid: torch.Tensor

    def __init__(
        self, q: torch.Tensor, grid: torch.Tensor, dequantized: Callable[[], torch.Tensor]
    ):
        super().__init__()
        self.q = q  # shared with the parametrization's FP8 tensor: no second copy
        self.register_buffer("grid", grid.contiguous())
        self.dequantized = dequantized  # () -> the weight in the run dtype
        self.failed = False

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.failed:
            try:
                return self._scaled(x, bias)
            except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel not here
                self.failed = True
                log.warning("W8A8 GEMM unavailable (%s); dequantizing this weight instead", exc)
        return nn.functional.linear(x, self.dequantized(), bias)

    def _scaled(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, scale = quantize_activations(rows)
        y = torch._scaled_mm(
            xq, self.q.t(), scale_a=scale, scale_b=self.grid.t(), out_dtype=x.dtype, bias=bias
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])


def w8a8_fits(weight: torch.Tensor, block: tuple[int, int], starts: tuple[int, int]) -> bool:
    """A 2-D weight this path can run: 128x128 blocks, K a multiple of 128, and this rank's
    shard starting on a block in both dimensions."""
    return (
        weight.dim() == 2
        and block == W8A8_BLOCK
        and weight.shape[1] % 128 == 0
        and all(s % 128 == 0 for s in starts)
    )
