"""Rotary position embeddings: the inverse frequencies (default, or YaRN's blend of
interpolated and extrapolated frequencies with its attention factor, GPT-OSS's), as
transformers computes them, and the rotation."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext


def rope_frequencies(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim / 2], factor)``: cos and sin are multiplied by ``factor``."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not scaling:
        return 1.0 / pos_freqs, 1.0
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor") or yarn_attention_factor(scaling)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]
    low, high = _correction_range(fast, slow, dim, theta, original, scaling.get("truncate", True))
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # the share of each frequency kept unscaled
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """What cos and sin are multiplied by: DeepSeek's ``mscale`` over ``mscale_all_dim`` where
    both are given (1 for DeepSeek-V3's, whose MLA scales its softmax instead:
    ``mla_softmax_factor``), else YaRN's own correction (GPT-OSS)."""
    factor, mscale, all_dim = (
        scaling["factor"],
        scaling.get("mscale"),
        scaling.get("mscale_all_dim"),
    )
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def mla_softmax_factor(scaling: dict[str, Any]) -> float:
    """DeepSeek's MLA under YaRN: its softmax scale times ``yarn_mscale(factor,
    mscale_all_dim)`` squared (1 without YaRN or ``mscale_all_dim``)."""
    all_dim = scaling.get("mscale_all_dim")
    return yarn_mscale(scaling["factor"], all_dim) ** 2 if scaling and all_dim else 1.0


def _correction_range(
    fast: float, slow: float, dim: int, theta: float, original: int, truncate: bool
) -> tuple[float, float]:
    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding(nn.Module):
    """Default RoPE, or YaRN (``scaling``: its parameters); ``interleaved`` pairs dims
    (0,1),(2,3)... as DeepSeek's checkpoints expect.

    Rotating half of ``x`` is ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2,
    x1)``; the table keeps sin with its first half negated, so the rotation is ``x * cos +
    roll(x) * sin``, four kernels and bit for bit the same. A forward looks each table's rows
    up once (``ForwardContext.rope``), for every layer whose RoPE is the same."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(
        self,
        dim: int,
        theta: float,
        interleaved: bool = False,
        scaling: dict[str, Any] | None = None,
    ):
        super().__init__()
        inv_freq, self.factor = rope_frequencies(dim, theta, scaling or {})  # YaRN: scaling
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved
        self.key = (dim, theta, interleaved, repr(sorted((scaling or {}).items())))
        self._cos_sin = inv_freq.new_zeros(0, 2, dim)  # per position, grown on demand

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Rotate ``x`` of shape ``[tokens, heads, dim]`` by each token's position."""
        cos, sin = self.rows(ctx, x.dtype)
        if self.interleaved:
            # de-interleave (x0, x1, x2, x3...) into (x0, x2, ..., x1, x3, ...) first
            t, h, d = x.shape
            x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def rows(self, ctx: ForwardContext, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at ``ctx``'s positions, ``[tokens, 1, dim]`` each. The table is
        bounded by ``ctx.position_end`` (host metadata: reading the bound from the positions
        would wait for the device)."""
        key = (self.key, dtype)
        if key not in ctx.rope:
            cos_sin = self._table(ctx.position_end)[ctx.positions].to(dtype)
            ctx.rope[key] = cos_sin[:, 0, None, :], cos_sin[:, 1, None, :]
        return ctx.rope[key]

    def allocate(self, positions: int) -> None:
        """The table for ``positions`` now, so it never moves later (a CUDA graph holds it)."""
        self._table(positions)

    def _table(self, need: int) -> torch.Tensor:
        have = self._cos_sin.shape[0]
        if need > have:
            n = max(need, 2 * have, 256)
            with torch.inference_mode(False):  # a plain tensor: usable outside inference too
                freqs = torch.arange(n, dtype=torch.float, device=self.inv_freq.device)[:, None]
                emb = torch.cat((freqs * self.inv_freq,) * 2, dim=-1)
                sin = emb.sin()
                sin[:, : sin.shape[1] // 2].neg_()  # rotate_half's sign, moved into the table
                self._cos_sin = torch.stack((emb.cos(), sin), dim=1)
                if self.factor != 1.0:
                    self._cos_sin *= self.factor
        return self._cos_sin
