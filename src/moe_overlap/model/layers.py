"""Building blocks shared by the model families."""

from __future__ import annotations

import itertools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.context import ForwardContext
from moe_overlap.distributed.groups import Group
from moe_overlap.model.tensor_parallel import ColumnLinear, RowLinear

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """``offset`` 1: a zero-centred norm (Qwen3.5), whose checkpoint weight is the scale's
    difference from 1; its scale is ``1 + weight``, taken in float32 as transformers does.

    One ``F.rms_norm`` call: torch's fused norm on CUDA (one or two kernels), where the form
    transformers writes takes eight. Its arithmetic is float32 throughout, the scale included, rounded once to the
    input's dtype; transformers rounds before it scales, so in bfloat16 the two may differ in
    the last bit (every mode and layout here runs this same norm)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            scale = self.offset + self.weight.float()
            return F.rms_norm(x.float(), scale.shape, scale, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


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


def attention_plan(ctx: ForwardContext) -> AttentionPlan:
    """``ctx``'s plan: built by its first attention layer, reused by the others."""
    if ctx.attention_plan is None:
        ctx.attention_plan = AttentionPlan.of(ctx.batch, ctx.kv_cache.device)
    return ctx.attention_plan


QUERY_BLOCK = 256  # queries per masked SDPA call on CPU
BIAS_REFUSED: list[str] = []  # why torch refused the lower-right causal bias, where it did
GPU_QUERY_BLOCK = 4096  # elsewhere: a mask of 4096 x keys, e.g. 256 MiB as bf16 at 32k keys


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    masks: dict[tuple[int, int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of ``q [n, new, heads, d]`` over ``n`` sequences' cached
    ``k/v [n, length, kv_heads, d]``; returns ``[n, new, heads, v_dim]``.

    New token i sits at position ``prefix_len + i`` and sees keys ``0 .. prefix_len + i``: the
    causal mask aligned to the lower right. With no prefix that is SDPA's own causal path; after
    a prefix, on a GPU torch's ``CausalBias`` (``_lower_right_bias``), elsewhere a boolean mask
    (what ``CausalBias`` materialises on CPU anyway), over blocks of at most ``QUERY_BLOCK``
    queries on CPU (its SDPA materialises each block's scores) and ``GPU_QUERY_BLOCK``
    elsewhere (a GPU's kernels do not, but take the mask as a bias of the run dtype: blocks
    bound that copy; TBO's second chunk of a 3072-token prompt took 6 calls per layer in blocks
    of 256, 1 now); ``masks`` keeps each block's mask for the next layer
    (``AttentionPlan.causal_masks``). GQA's shared KV heads are broadcast by SDPA
    (``enable_gqa``), never copied.
    """
    masks = {} if masks is None else masks
    new, length = q.shape[1], k.shape[1]
    assert length == prefix_len + new, "keys must cover exactly the prefix and the new tokens"
    block = QUERY_BLOCK if q.device.type == "cpu" else GPU_QUERY_BLOCK
    if not prefix_len or new <= block:
        return _attend(q, k, v, prefix_len, scale, masks)
    parts = -(-new // block)  # near-equal blocks of at most ``block`` queries
    bounds = [new * i // parts for i in range(parts + 1)]
    blocks = [
        _attend(
            q[:, a:b], k[:, : prefix_len + b], v[:, : prefix_len + b], prefix_len + a, scale, masks
        )
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(blocks, dim=1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    scale: float,
    masks: dict[tuple[int, int], torch.Tensor],
) -> torch.Tensor:
    new, length = q.shape[1], k.shape[1]
    # the bias where FlashAttention runs it (one head width for q, k and v); MLA's values are
    # narrower than its keys (128 against 192), and there an H200 ran the bias at half the
    # boolean mask's speed (TBO's second chunk of 4096: 0.58 ms against 0.29 ms)
    flash = q.shape[-1] == v.shape[-1]
    if prefix_len and flash and q.device.type == "cuda" and not BIAS_REFUSED:
        try:
            return _sdpa(q, k, v, _lower_right_bias(new, length), scale)
        except RuntimeError as exc:  # not yet run on a GPU: a refusal falls back, said once
            BIAS_REFUSED.append(str(exc))
            log.warning(
                "attention after a prefix takes a boolean mask: torch refused its "
                "lower-right causal bias here (%s)",
                exc,
            )
    mask = None
    if prefix_len:
        if (new, length) not in masks:
            masks[new, length] = _lower_right_causal(new, length, q.device)
        mask = masks[new, length]
    return _sdpa(q, k, v, mask, scale)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,  # no prefix: upper-left and lower-right causal agree
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _lower_right_causal(new: int, length: int, device: torch.device) -> torch.Tensor:
    return torch.ones(new, length, dtype=torch.bool, device=device).tril(diagonal=length - new)


def _lower_right_bias(new: int, length: int) -> torch.Tensor:
    """The lower-right causal mask as torch's ``CausalBias``, for a GPU: SDPA runs it as
    FlashAttention's causal kernel (which aligns to the lower right when there are more keys
    than queries) or the memory-efficient kernel's lower-right mode, nothing materialised and
    the masked blocks skipped. With a boolean mask, a chunk after a prefix (TBO's second
    chunk, chunked prefill, a prefix-cache hit, a verify step) took the memory-efficient
    kernel, every block computed and the mask read; under GQA not even that, as that kernel
    cannot broadcast shared KV heads: SDPA fell back to its math kernel, every score
    materialised. Where neither fused kernel fits (fp32, say) torch materialises the mask."""
    from torch.nn.attention.bias import causal_lower_right  # imports dynamo: 1 s, GPU only

    return causal_lower_right(new, length)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One new token per sequence: ``q [B, heads, d]`` over padded ``k/v [B, L, kv_heads, d]``,
    sequence b seeing the keys ``mask [B, 1, 1, L]`` marks (``AttentionPlan.decode_mask``; all
    ``L`` when None: no mask, the faster kernel). Returns ``[B, heads, v_dim]``.

    No repeated K/V: on a GPU the query heads sharing a KV head attend as that head's queries
    (``[B, kv_heads, group, d]``, SDPA's fused path with a key-padding mask); on a CPU each
    head's one query attends with ``enable_gqa``, which its kernel spreads over more work.
    """
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    if q.device.type == "cpu":  # one query row per head: the CPU kernel's GQA form, 2-2.5x
        # faster at a decode batch of 128 than a head group's queries as rows of one KV head
        out = F.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), mask, scale=scale, enable_gqa=True
        )
    else:  # grouped: a GPU's memory-efficient kernel takes the mask, but not enable_gqa
        out = F.scaled_dot_product_attention(
            q.reshape(b, kv_heads, heads // kv_heads, d),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
        )
    return out.reshape(b, heads, v.shape[-1])
