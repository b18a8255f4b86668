"""Building blocks shared by both model families."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE; ``interleaved`` pairs dims (0,1),(2,3)... as DeepSeek's checkpoints expect."""

    def __init__(self, dim: int, theta: float, interleaved: bool = False):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[tokens, heads, dim]`` by each token's position."""
        freqs = positions[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :].to(x.dtype), emb.sin()[:, None, :].to(x.dtype)
        if self.interleaved:
            # de-interleave (x0, x1, x2, x3...) into (x0, x2, ..., x1, x3, ...) first
            t, h, d = x.shape
            x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the Hugging Face parameter names (dense layers and shared experts)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Attention of ``q [new, heads, d]`` over a sequence's cached ``k/v [len, kv_heads, d]``.

    New token i sits at position ``prefix_len + i`` and sees keys ``0 .. prefix_len + i``: the
    causal mask aligned to the lower right, which (with 4-D inputs) takes SDPA's fused CPU path.
    """
    new, length = q.shape[0], k.shape[0]
    assert length == prefix_len + new, "keys must cover exactly the prefix and the new tokens"
    if q.shape[1] != k.shape[1]:  # GQA: the fused path wants one key head per query head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=causal_lower_right(new, length),
        scale=scale,
    )
    return out[0].transpose(0, 1)
