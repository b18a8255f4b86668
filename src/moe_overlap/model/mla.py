"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent per token.

Per token the cache keeps ``latent`` (``kv_lora_rank``, after ``kv_a_layernorm``) and ``k_pe``
(``qk_rope_head_dim``, already rotated). Each forward expands the cached latents of a sequence
through ``kv_b_proj`` into per-head ``k_nope`` and ``v``, so a later chunk of a prompt sees exactly
the prefix that an earlier chunk wrote.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.distributed.groups import Group
from moe_overlap.model.layers import (
    RMSNorm,
    attention_plan,
    causal_attention,
    decode_attention,
)
from moe_overlap.model.rope import RotaryEmbedding, mla_softmax_factor
from moe_overlap.model.tensor_parallel import ColumnLinear, RowLinear

# DeepSeek builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps.
_LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (``q_a_proj``, ``kv_b_proj``, ...)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, group: Group | None = None):
        super().__init__()
        group = group or Group.single()
        self.layer_id = layer_id
        heads = cfg.num_attention_heads
        self.heads = heads // group.size  # this rank's heads (attention TP)
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        h = cfg.hidden_size
        self.q_lora = cfg.q_lora_rank is not None
        # the LoRA down-projections and the latent are replicated; the per-head up-projections
        # are split by heads, o_proj by its input columns (SGLang's split)
        rank = cfg.q_lora_rank
        if rank is None:  # DeepSeek-V2-Lite: a plain query projection
            self.q_proj = ColumnLinear.even(h, heads * self.qk_dim, group)
        else:
            self.q_a_proj = nn.Linear(h, rank, bias=False)
            self.q_a_layernorm = RMSNorm(rank, _LORA_NORM_EPS)
            self.q_b_proj = ColumnLinear.even(rank, heads * self.qk_dim, group)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, _LORA_NORM_EPS)
        self.kv_b_proj = ColumnLinear.even(
            self.kv_rank, heads * (self.nope_dim + self.v_dim), group
        )
        self.o_proj = RowLinear(heads * self.v_dim, h, group)
        self.rotary = RotaryEmbedding(
            self.rope_dim, cfg.rope_theta, cfg.rope_interleave, cfg.rope_scaling
        )
        self.scale = self.qk_dim**-0.5 * mla_softmax_factor(cfg.rope_scaling)  # YaRN's

    def kv_entries(self) -> dict[str, tuple[int, ...]]:
        return {"latent": (self.kv_rank,), "k_pe": (self.rope_dim,)}

    def prepare(self, ctx: ForwardContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Return ``(q [T, heads, nope+rope], latent [T, kv_rank], k_pe [T, rope])``."""
        t = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(t, self.heads, self.qk_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        # q's heads and the one shared k_pe rotate as one tensor: one rotation's kernels
        rotated = self.rotary(torch.cat((q_pe, k_pe[:, None, :]), dim=1), ctx)
        q = torch.cat((q_nope, rotated[:, : self.heads]), dim=-1)
        return q, self.kv_a_layernorm(latent), rotated[:, self.heads]

    def core(
        self, ctx: ForwardContext, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        plan, cache, layer = attention_plan(ctx), ctx.kv_cache, self.layer_id
        bounds = (ctx.position_end, ctx.slot_end)
        cache.store(layer, plan.slots, ctx.positions, bounds, plan.pages, latent=latent, k_pe=k_pe)
        out = q.new_empty(q.shape[0], self.heads, self.v_dim)
        if plan.decode_max_len:
            keys, values = self._expand(
                cache.gather(
                    layer, "latent", plan.decode_slots, plan.decode_max_len, 0, plan.pages
                ),
                cache.gather(layer, "k_pe", plan.decode_slots, plan.decode_max_len, 0, plan.pages),
            )
            q_dec = q if plan.all_decode else q[plan.decode_rows]
            dec = decode_attention(q_dec, keys, values, plan.decode_mask(keys.shape[1]), self.scale)
            if plan.all_decode:
                out = dec
            else:
                out[plan.decode_rows] = dec
        for group in plan.extends:
            keys, values = self._expand(
                cache.gather(layer, "latent", group.slots, group.length, 0, plan.pages),
                cache.gather(layer, "k_pe", group.slots, group.length, 0, plan.pages),
            )
            q_group = q[group.rows].unflatten(0, (-1, group.new))
            attended = causal_attention(
                q_group, keys, values, group.prefix, self.scale, plan.causal_masks
            )
            out[group.rows] = attended.flatten(0, 1)
        # explicit width: an idle micro-batch has zero tokens, and reshape(0, -1) is ambiguous
        return self.o_proj(out.reshape(out.shape[0], self.heads * self.v_dim))

    def _expand(
        self, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents ``[..., L, kv_rank]`` and ``k_pe [..., L, rope]`` -> per-head keys
        ``[..., L, heads, nope+rope]`` and values ``[..., L, heads, v]``."""
        lead = latent.shape[:-1]
        kv = self.kv_b_proj(latent).view(*lead, self.heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # k_pe is shared by all heads (the "mqa" in kv_a_proj_with_mqa)
        k_pe = k_pe[..., None, :].expand(*lead, self.heads, self.rope_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v
