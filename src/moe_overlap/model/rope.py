"""RoPE's inverse frequencies: default, or YaRN's blend of interpolated and extrapolated
frequencies with its attention factor (GPT-OSS), as transformers computes them."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_frequencies(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2], factor)``: cos and sin are multiplied by ``factor``."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not scaling:
        return 1.0 / pos_freqs, 1.0
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor") or _mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]
    low, high = _correction_range(fast, slow, dim, theta, original, scaling.get("truncate", True))
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # the share of each frequency kept unscaled
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _correction_range(
    fast: float, slow: float, dim: int, theta: float, original: int, truncate: bool
) -> tuple[float, float]:
    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
