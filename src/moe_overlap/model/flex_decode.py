"""Decode attention that reads the KV pages where they lie (``--attention-backend
flex_attention``, SGLang's name for it): FlexAttention over the whole page pool, with a block
mask whose KV blocks are each sequence's own pages, one block per page, straight from the block
table. No sequence's keys are copied into a contiguous tensor first, as the default
(``torch_native``: ``KVCache.gather`` then SDPA) does.

The mask is built once per forward and read by every layer. Its block list is the block
table itself, ``[rows, pages per sequence + 1]`` int32 (torch 2.13's decode template reads a
row's indices only below its count; the spare column guards a next-block read one past it,
not confirmed in the source), not a row as
long as the pool has pages, which FlexAttention's own layout (and torch's paged FlexAttention)
would build each forward over the whole pool; ``wide`` builds that one, for the GPU test that
compares the two. Only the last page of a row can be partly written, so ``mask_mod`` needs two
numbers per row; a page shared by prefix caching is full, and sits in every row that holds it.

On a GPU the kernel is ``torch.compile``'d FlexAttention (Triton), its key tile the largest
power of two up to 64 that divides a page (pages of a multiple of 16 tokens, so a tile is 16
at least; the settings refuse others there). On a CPU one SDPA over the
whole pool with the mask that kernel applies (``masked_reference``): a check of exactness, not
a fast path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.kv_cache import KVCache

Q_BLOCK = 128  # one block of queries: a decode row's one query


WIDE = False  # the block list as long as the pool (tests/gpu compares it with the table's)


def decode_block_mask(
    table: torch.Tensor, lens: torch.Tensor, page_size: int, pool_pages: int
) -> BlockMask:
    """The mask of decode rows over a pool of ``pool_pages`` pages: row b visits the first
    ``ceil(lens[b] / page_size)`` pages of ``table[b]`` (its blocks, one per page), and of
    them sees every key but its last page's past ``lens[b]`` (``mask_mod``, which needs only
    that page and its count of real keys: the kernel applies it within the visited blocks)."""
    rows = table.shape[0]
    width = min(table.shape[1], pool_pages)  # a row's pages are distinct pool pages
    count = (lens + page_size - 1) // page_size
    last = table.gather(1, (count - 1)[:, None])[:, 0]
    last_len = lens - (count - 1) * page_size
    columns = pool_pages if WIDE else width + 1  # the spare: a read one past a row lands here
    indices = table.new_zeros(rows, columns, dtype=torch.int32)  # then unvisited blocks
    indices[:, :width] = table[:, :width]

    def real_key(b, h, q_idx, kv_idx):
        return (kv_idx // page_size != last[b]) | (kv_idx % page_size < last_len[b])

    return BlockMask.from_kv_blocks(
        count.view(rows, 1, 1).to(torch.int32),
        indices.view(rows, 1, 1, columns),
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
    gqa = q.shape[1] != keys.shape[1]
    if q.device.type != "cuda":
        out = masked_reference(q[:, :, None], keys, values, plan.decode_block_mask, scale, gqa)
        return out[:, :, 0]
    tile = {"BLOCK_N": math.gcd(cache.page_size, 64)}  # key tiles must fill a block (a page)
    mask = plan.decode_block_mask
    out = _compiled()(
        q[:, :, None],
        keys,
        values,
        block_mask=mask,
        scale=scale,
        enable_gqa=gqa,
        kernel_options=tile,
    )
    return out[:, :, 0]


@functools.cache
def _compiled():
    """FlexAttention compiled (Triton), once per process."""
    return torch.compile(flex_attention, dynamic=True)


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
    applies the mod alone, where this mask needs the blocks, and costs seconds to start)."""
    rows, kv_len = q.shape[0], k.shape[2]
    page = block_mask.BLOCK_SIZE[1]
    visited = _visited(block_mask, kv_len // page)  # [rows, kv blocks]
    blocks = torch.arange(kv_len, device=q.device) // page
    b = torch.arange(rows, device=q.device)[:, None]
    kv = torch.arange(kv_len, device=q.device)[None]
    zero = torch.zeros((), dtype=torch.long, device=q.device)
    seen = visited[:, blocks].bool() & block_mask.mask_mod(b, zero, zero, kv)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=seen[:, None, None], scale=scale, enable_gqa=enable_gqa
    )


def _visited(block_mask: BlockMask, pool_pages: int) -> torch.Tensor:
    """``[rows, pool_pages]``: which pool pages each row's first ``kv_num_blocks`` indices name
    (``to_dense`` would take the block list's length for the pool's)."""
    indices = block_mask.kv_indices[:, 0, 0].long()
    count = block_mask.kv_num_blocks[:, 0, 0]
    taken = torch.arange(indices.shape[1], device=indices.device) < count[:, None]
    visited = torch.zeros(indices.shape[0], pool_pages, dtype=torch.long, device=indices.device)
    return visited.scatter_reduce_(1, indices.clamp(0, pool_pages - 1), taken.long(), "amax")
