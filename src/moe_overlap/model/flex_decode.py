"""Decode attention that reads the KV pages where they lie (``--attention-backend
flex_attention``, SGLang's name for it): FlexAttention over the whole page pool, with a block
mask whose KV blocks are each sequence's own pages, one block per page, straight from the block
table. No sequence's keys are copied into a contiguous tensor first, as the default
(``torch_native``: ``KVCache.gather`` then SDPA) does.

The mask holds each page's place in each decode row (``[rows, pool pages]``, built once per
forward and read by every layer): a page shared by prefix caching has its place in every row
that holds it.

On a GPU the kernel is ``torch.compile``'d FlexAttention (Triton). On a CPU one SDPA over the
whole pool with the mask that kernel applies (``masked_reference``): a check of exactness, not
a fast path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.kv_cache import KVCache

Q_BLOCK = 128  # one block of queries: a decode row's one query


def decode_block_mask(
    table: torch.Tensor, lens: torch.Tensor, page_size: int, pool_pages: int
) -> BlockMask:
    """The mask of decode rows over a pool of ``pool_pages`` pages: row b sees the first
    ``lens[b]`` keys of its pages (``table[b]``, in order). Its blocks (one per page) are the
    row's pages, and its ``mask_mod`` says the same from each page's place in the row
    (``logical``, -1 where the row does not hold the page): the kernel skips the blocks, an
    unfused run (CPU) applies the mod everywhere, and both see the same keys."""
    rows = table.shape[0]
    width = min(table.shape[1], pool_pages)  # a row's pages are distinct pool pages
    count = (lens + page_size - 1) // page_size
    places = torch.arange(width, device=table.device).expand(rows, width)
    held = torch.where(places < count[:, None], table[:, :width], pool_pages)  # else: a spare
    logical = table.new_full((rows, pool_pages + 1), -1).scatter_(1, held, places)
    indices = table.new_zeros(rows, pool_pages)  # a row's pages, then blocks never visited
    indices[:, :width] = table[:, :width]

    def real_key(b, h, q_idx, kv_idx):
        place = logical[b, kv_idx // page_size]
        return (place >= 0) & (place * page_size + kv_idx % page_size < lens[b])

    return BlockMask.from_kv_blocks(
        count.view(rows, 1, 1).to(torch.int32),
        indices.view(rows, 1, 1, pool_pages).to(torch.int32),
        BLOCK_SIZE=(Q_BLOCK, page_size),
        mask_mod=real_key,
        seq_lengths=(1, pool_pages * page_size),
        compute_q_blocks=False,
    )


def paged_decode(
    q: torch.Tensor, cache: KVCache, layer: int, plan: AttentionPlan, scale: float
) -> torch.Tensor:
    """``q [B, heads, d]`` of the plan's decode rows over their cached keys, read in place:
    ``[B, heads, v_dim]``. The block mask is built by the first layer and kept on the plan."""
    k_pool, v_pool = cache.layers[layer]["k"], cache.layers[layer]["v"]
    if plan.decode_block_mask is None:
        lens = plan.decode_lens
        table = cache.block_table[plan.decode_slots]
        if lens is None:  # every row sees all decode_max_len keys
            lens = torch.full((table.shape[0],), plan.decode_max_len, device=table.device)
        plan.decode_block_mask = decode_block_mask(
            table, lens.to(table.device), cache.page_size, k_pool.shape[0]
        )
    keys = k_pool.flatten(0, 1).transpose(0, 1)[None]  # [1, kv_heads, pool tokens, d]
    values = v_pool.flatten(0, 1).transpose(0, 1)[None]
    out = _flex(q.device.type)(
        q[:, :, None],
        keys,
        values,
        block_mask=plan.decode_block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out[:, :, 0]


@functools.cache
def _flex(device_type: str):
    """FlexAttention compiled on a GPU; on a CPU, ``masked_reference``."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    return masked_reference


def masked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """What the compiled kernel computes, as one SDPA over the whole pool: each row sees the
    keys of the blocks it visits that ``mask_mod`` keeps (FlexAttention's own unfused run
    applies the mod alone, and costs seconds to start)."""
    rows, kv_len = q.shape[0], k.shape[2]
    visited = block_mask.to_dense()[:, 0, 0]  # [rows, kv blocks]
    blocks = torch.arange(kv_len, device=q.device) // block_mask.BLOCK_SIZE[1]
    b = torch.arange(rows, device=q.device)[:, None]
    kv = torch.arange(kv_len, device=q.device)[None]
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    seen = visited[:, blocks].bool() & block_mask.mask_mod(b, zero, zero, kv)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=seen[:, None, None], scale=scale, enable_gqa=enable_gqa
    )
