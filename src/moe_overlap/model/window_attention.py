"""Attention with a sliding window and learned sinks (GPT-OSS; MiMo-V2-Flash's sliding layers).

A query at position p sees the keys at positions ``p - window < pos <= p`` (``window`` 0: every
key up to p), and its softmax has one more logit per head, the sink, whose weight is dropped:
``softmax([scores, sink])[:-1] @ V``. SDPA has no sink, so a windowed layer's scores are
computed here, over blocks of at most ``QUERY_BLOCK`` queries, each over only the keys its window
reaches. A full layer's prompt (GPT-OSS: every other layer) runs as SDPA, the sink as one more
key (``sink_attention``), so a GPU runs it in a fused kernel, never materialising its scores.
"""

from __future__ import annotations

import torch

from moe_overlap.model.layers import QUERY_BLOCK, causal_attention


def first_key(start: int, window: int) -> int:
    """The first key position a query at ``start`` sees."""
    return max(0, start - window + 1) if window else 0


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    key_start: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``q [n, new, heads, d]`` (positions ``prefix ..``) over ``k/v [n, keys, kv_heads, .]``
    (positions ``key_start ..``, up to the last query's); returns ``[n, new, heads, v_dim]``."""
    new = q.shape[1]
    parts = max(1, -(-new // QUERY_BLOCK))
    bounds = [new * i // parts for i in range(parts + 1)]
    blocks = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        lo, hi = first_key(prefix + a, window) - key_start, prefix + b - key_start
        q_pos = torch.arange(prefix + a, prefix + b, device=q.device)
        k_pos = torch.arange(key_start + lo, key_start + hi, device=q.device)
        seen = _seen(q_pos[None, :, None], k_pos[None, None, :], window)  # [1, m, keys]
        blocks.append(_attend(q[:, a:b], k[:, lo:hi], v[:, lo:hi], seen, scale, sinks))
    return torch.cat(blocks, dim=1)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float,
    sinks: torch.Tensor,
    masks: dict[tuple[int, int], torch.Tensor],
) -> torch.Tensor:
    """Causal attention with a learned sink per query head, as SDPA: ``q [n, new, heads, d]``
    after ``prefix`` tokens over ``k/v [n, prefix + new, kv_heads, .]``; returns
    ``[n, new, heads, v_dim]``.

    The sink becomes key 0 of every sequence, seen by every query (the lower-right causal mask
    over one more key), with a value of zeros: each head's ``q`` gains a column holding its
    sink, every key a column of 0 there, and the sink key ``1 / scale``, so its score is the
    sink. Heads are padded to a multiple of 8 (what fused kernels take) and ``v`` to the same
    width (SDPA's fused kernels want one head size); the pad is dropped from the output.
    """
    n, new, heads, d = q.shape
    length, kv_heads, v_dim = k.shape[1], k.shape[2], v.shape[-1]
    width = -(-(max(d, v_dim) + 1) // 8) * 8
    q_ = q.new_zeros(n, new, heads, width)
    q_[..., :d] = q
    q_[..., d] = sinks.to(q.dtype)
    k_ = k.new_zeros(n, 1 + length, kv_heads, width)
    k_[:, 1:, :, :d] = k
    k_[:, 0, :, d] = 1 / scale
    v_ = v.new_zeros(n, 1 + length, kv_heads, width)
    v_[:, 1:, :, :v_dim] = v
    return causal_attention(q_, k_, v_, prefix + 1, scale, masks)[..., :v_dim]


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor | None,
    key_start: int,
    scale: float,
    window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One query per sequence, ``q [B, heads, d]``, sequence b's at position ``lens[b] - 1``
    (all at ``key_start + keys - 1`` when ``lens`` is None), over ``k/v [B, keys, kv_heads, .]``
    from position ``key_start``; returns ``[B, heads, v_dim]``."""
    keys = k.shape[1]
    k_pos = torch.arange(key_start, key_start + keys, device=q.device)
    q_pos = torch.full((1,), key_start + keys - 1, device=q.device) if lens is None else lens - 1
    seen = _seen(q_pos[:, None, None], k_pos[None, None, :], window)  # [B or 1, 1, keys]
    return _attend(q[:, None], k, v, seen, scale, sinks)[:, 0]


def _seen(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    seen = k_pos <= q_pos
    return seen & (k_pos > q_pos - window) if window else seen


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``q [n, m, heads, d]``, ``k/v [n, keys, kv_heads, .]``, ``seen [n or 1, m, keys]``."""
    n, m, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    # the query heads sharing a KV head attend as one [group x m] block: no repeated K/V
    q5 = q.view(n, m, kv_heads, group, d).permute(0, 2, 3, 1, 4)
    scores = (q5 @ k.permute(0, 2, 3, 1)[:, :, None]).float() * scale  # [n, kv, group, m, keys]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, group, 1, 1).expand(n, -1, -1, m, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = probs.to(v.dtype) @ v.permute(0, 2, 1, 3)[:, :, None]  # [n, kv, group, m, v_dim]
    return out.permute(0, 3, 1, 2, 4).reshape(n, m, heads, v.shape[-1])
