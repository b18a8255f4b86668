"""Which kernel runs an expert bank's rows (``model/moe.py``): torch's grouped GEMM where it
fits, else one batched matmul over rows padded per expert, or a matmul per expert."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moe_overlap.core.transfer import to_device

# When one batched matmul over every expert (each padded to the fullest) beats a matmul per
# expert: always for few rows per expert, where the loop's per-call overhead dominates; above
# that only while the padding stays small (the measurements behind the bounds: docs/tuning.md).
_BATCHED_ANY_ROWS = 64
_BATCHED_EVEN_ROWS = 192
_BATCHED_MAX_PADDING = 1.25


# torch's grouped GEMM: F.grouped_mm where this torch has it, else torch._grouped_mm (bf16 on
# CUDA): the experts run as one kernel per projection instead of one matmul per expert
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_fits(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Whether the experts run as a grouped GEMM: torch has one, the rows are bf16 on an sm90+
    GPU (its kernel's target), and every row is 16-byte aligned (dims multiples of 8).
    Elsewhere, fp32 on CPU included, the padded batched matmul or the per-expert loop runs,
    unchanged. bf16 on ``meta`` (a dry run that counts a GPU's kernels, ``tools/device_ops.py``)
    takes the GPU's path."""
    if GROUPED_MM is None or device.type not in ("cuda", "meta") or dtype != torch.bfloat16:
        return False
    gpu = device.type == "meta" or _capability(device) >= (9, 0)
    return gpu and all(d % 8 == 0 for d in dims)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:  # asked once per device
    return torch.cuda.get_device_capability(device)


def batched_pays(counts: list[int], height: int) -> bool:
    """Pad and batch when every expert is small, or evenly loaded and not large."""
    if height <= _BATCHED_ANY_ROWS:
        return True
    padded = height * len(counts)
    return height <= _BATCHED_EVEN_ROWS and padded <= _BATCHED_MAX_PADDING * sum(counts)


def padded_positions(counts: list[int], height: int, device: torch.device) -> torch.Tensor:
    """Row i of expert e (in ``counts``' order) goes to padded row ``e * height + i`` (worked
    out on the host from the host's counts, then sent: no read of the device)."""
    sizes = torch.tensor(counts)
    expert = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    first = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return to_device(expert * height + torch.arange(expert.numel()) - first, device)
