"""Building blocks shared by the model families."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.transfer import to_device
from moe_overlap.distributed.groups import Group
from moe_overlap.model.rope import rope_frequencies
from moe_overlap.model.tensor_parallel import ColumnLinear, RowLinear


class RMSNorm(nn.Module):
    """``offset`` 1: a zero-centred norm (Qwen3.5), whose checkpoint weight is the scale's
    difference from 1; its scale is ``1 + weight``, taken in float32 as transformers does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == self.weight.dtype == torch.float32:  # one op, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE, or YaRN (``scaling``: its parameters); ``interleaved`` pairs dims
    (0,1),(2,3)... as DeepSeek's checkpoints expect."""

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
        self._cos_sin = inv_freq.new_zeros(0, 2, dim)  # per position, grown on demand

    def forward(self, x: torch.Tensor, positions: torch.Tensor, end: int) -> torch.Tensor:
        """Rotate ``x`` of shape ``[tokens, heads, dim]`` by each token's position; ``end``
        bounds the positions (host metadata: reading it from them would wait for the device)."""
        cos_sin = self._table(end)[positions].to(x.dtype)  # one lookup, not cos/sin per call
        cos, sin = cos_sin[:, 0, None, :], cos_sin[:, 1, None, :]
        if self.interleaved:
            # de-interleave (x0, x1, x2, x3...) into (x0, x2, ..., x1, x3, ...) first
            t, h, d = x.shape
            x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
        return x * cos + _rotate_half(x) * sin

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
                self._cos_sin = torch.stack((emb.cos(), emb.sin()), dim=1)
                if self.factor != 1.0:
                    self._cos_sin *= self.factor
        return self._cos_sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP with the Hugging Face parameter names (dense layers and shared experts),
    tensor parallel over ``group``: gate and up split by columns, down by rows."""

    def __init__(self, hidden: int, intermediate: int, group: Group | None = None):
        super().__init__()
        group = group or Group.single()
        self.gate_proj = ColumnLinear.even(hidden, intermediate, group)
        self.up_proj = ColumnLinear.even(hidden, intermediate, group)
        self.down_proj = RowLinear(intermediate, hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class ExtendGroup:
    """Sequences that extend by the same ``new`` tokens after the same ``prefix`` cached ones:
    one batched attention call with one causal mask."""

    prefix: int
    new: int
    slots: torch.Tensor | slice  # their cache slots, a slice when consecutive (no copy)
    rows: torch.Tensor | slice  # their token rows, sequence after sequence

    @property
    def length(self) -> int:
        return self.prefix + self.new


@dataclass
class AttentionPlan:
    """Where one forward's tokens go in the KV cache and how attention runs over them.

    Sequences with one new token (decode steps) attend in one batched call over their cached
    rows padded to the longest; longer extends (prefill chunks) in one call per group of
    equal prefix and length (a batch of fresh prompts of one length is one call).
    """

    slots: torch.Tensor  # [T] the cache slot of every new token
    decode_rows: torch.Tensor  # [B] the token row of each one-token sequence
    decode_slots: torch.Tensor | slice  # [B], or a slice when they are consecutive (no copy)
    decode_lens: torch.Tensor | None  # [B] keys each attends over; None: all decode_max_len
    decode_max_len: int
    decode_min_len: int  # the shortest: a sliding window's decode reads from its first key
    extends: list[ExtendGroup]
    all_decode: bool  # every token is a decode row, in batch order

    @classmethod
    def of_context(cls, ctx: ForwardContext) -> AttentionPlan:
        """``ctx``'s plan: built by its first attention layer, reused by the others."""
        if ctx.attention_plan is None:
            ctx.attention_plan = cls.of(ctx.batch, ctx.kv_cache.device)
        return ctx.attention_plan

    @classmethod
    def of(cls, batch: ForwardBatch, device: torch.device | str = "cpu") -> AttentionPlan:
        """The plan of ``batch``, its index tensors on ``device`` (the KV cache's)."""
        staged = batch.device_inputs
        if staged is not None:  # decode rows in device buffers: every key count is masked
            return cls(
                slots=staged.slots,
                decode_rows=torch.arange(0),  # unread: every row is a decode row
                decode_slots=staged.slots,
                decode_lens=staged.positions + 1,  # keys each attends over
                decode_max_len=staged.max_len,
                decode_min_len=1,  # a padding row's; a window then reads from key 0, masked
                extends=[],
                all_decode=True,
            )
        rows, slots, lens = [], [], []
        groups: dict[tuple[int, int], list[tuple[int, slice]]] = {}
        for slot, prefix, span in batch.per_sequence():
            if span.stop - span.start == 1:
                rows.append(span.start)
                slots.append(slot)
                lens.append(prefix + 1)
            else:
                groups.setdefault((prefix, span.stop - span.start), []).append((slot, span))

        def longs(items: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(items, dtype=torch.long), device)

        def token_rows(spans: list[slice]) -> torch.Tensor | slice:
            if all(a.stop == b.start for a, b in itertools.pairwise(spans)):
                return slice(spans[0].start, spans[-1].stop)
            return longs([i for span in spans for i in range(span.start, span.stop)])

        extends = [
            ExtendGroup(
                prefix,
                new,
                _as_slice([slot for slot, _ in members]) or longs([slot for slot, _ in members]),
                token_rows([span for _, span in members]),
            )
            for (prefix, new), members in groups.items()
        ]
        return cls(
            slots=longs(
                [s for s, n in zip(batch.slots, batch.extend_lens, strict=True) for _ in range(n)]
            ),
            decode_rows=longs(rows),
            decode_slots=_as_slice(slots) or longs(slots),
            decode_lens=longs(lens) if len(set(lens)) > 1 else None,  # equal: no mask
            decode_max_len=max(lens, default=0),
            decode_min_len=min(lens, default=0),
            extends=extends,
            all_decode=not extends,
        )


def _as_slice(items: list[int]) -> slice | None:
    """``slice(a, a + n)`` if ``items`` are ``a, a + 1, ..., a + n - 1``, else None."""
    if items and items == list(range(items[0], items[0] + len(items))):
        return slice(items[0], items[0] + len(items))
    return None


# A query block's share of a chunk that attends over a prefix: SDPA's masked path works through
# every (query, key) pair of its rectangle, so a long chunk attends block by block, each over the
# keys up to its own end; the block size is the best of those tried (docs/tuning.md).
QUERY_BLOCK = 256


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Attention of ``q [n, new, heads, d]`` over ``n`` sequences' cached
    ``k/v [n, length, kv_heads, d]``; returns ``[n, new, heads, v_dim]``.

    New token i sits at position ``prefix_len + i`` and sees keys ``0 .. prefix_len + i``: the
    causal mask aligned to the lower right. With no prefix that is SDPA's own causal path; after
    a prefix, a boolean mask (what torch's ``CausalBias`` materialises on CPU anyway, without
    importing its dynamo machinery into every rank), over blocks of at most ``QUERY_BLOCK``
    queries. GQA's shared KV heads are broadcast by SDPA (``enable_gqa``), never copied.
    """
    new, length = q.shape[1], k.shape[1]
    assert length == prefix_len + new, "keys must cover exactly the prefix and the new tokens"
    if not prefix_len or new <= QUERY_BLOCK:
        return _attend(q, k, v, prefix_len, scale)
    parts = -(-new // QUERY_BLOCK)  # near-equal blocks of at most QUERY_BLOCK queries
    bounds = [new * i // parts for i in range(parts + 1)]
    blocks = [
        _attend(q[:, a:b], k[:, : prefix_len + b], v[:, : prefix_len + b], prefix_len + a, scale)
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(blocks, dim=1)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    new, length = q.shape[1], k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=_lower_right_causal(new, length, q.device) if prefix_len else None,
        is_causal=not prefix_len,  # no prefix: upper-left and lower-right causal agree
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _lower_right_causal(new: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(new, length, dtype=torch.bool, device=device).tril(diagonal=length - new)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One new token per sequence: ``q [B, heads, d]`` over padded ``k/v [B, L, kv_heads, d]``,
    sequence b seeing its first ``lens[b]`` keys (all ``L`` when ``lens`` is None: no mask, the
    faster kernel). Returns ``[B, heads, v_dim]``.

    The query heads sharing a KV head attend as that head's queries (``[B, kv_heads, group,
    d]``): no repeated K/V, and SDPA's fused path with a key-padding mask.
    """
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    mask = None
    if lens is not None:
        mask = (torch.arange(k.shape[1], device=k.device) < lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.reshape(b, kv_heads, heads // kv_heads, d),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(b, heads, v.shape[-1])
