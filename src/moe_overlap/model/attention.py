"""Grouped-query attention with per-head q/k RMSNorm (Qwen3-MoE); Qwen3.5-MoE's variant has
an output gate per head (``q_proj`` yields each head's query then its gate) and zero-centred
q/k norms; GLM-4.5's has biased q/k/v and the q/k norm optional. Qwen3.5 and GLM-4.5 rotate
only the first ``rotary_dim`` dims of each head. GPT-OSS's has biases on every projection,
learned sinks, YaRN RoPE and, in its sliding layers, a window (``model/window_attention.py``)."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.distributed.groups import Group
from moe_overlap.model.flex_decode import paged_decode
from moe_overlap.model.layers import (
    RMSNorm,
    attention_plan,
    causal_attention,
    decode_attention,
)
from moe_overlap.model.rope import RotaryEmbedding
from moe_overlap.model.tensor_parallel import ColumnLinear, RowLinear, set_shard
from moe_overlap.model.window_attention import decode_attention as window_decode
from moe_overlap.model.window_attention import extend_attention, first_key, sink_attention


class GQAttention(nn.Module):
    """Query heads split over the attention-TP ``group``; KV heads split too, or replicated
    (each rank holding the one its query heads share) when there are fewer than ranks."""

    def __init__(self, cfg: ModelConfig, layer_id: int, group: Group | None = None):
        super().__init__()
        group = group or Group.single()
        self.layer_id = layer_id
        h, d, dv = cfg.hidden_size, cfg.head_size, cfg.value_head_size
        heads, kv_heads = cfg.num_attention_heads, cfg.kv_heads(layer_id)
        self.heads, self.head_dim, self.v_dim = heads // group.size, d, dv
        self.kv_heads = max(1, kv_heads // group.size)
        # the first KV head this rank holds: its share, or the one its query heads map to
        first_kv = group.rank * self.heads // (heads // kv_heads)
        kv_heads_held = range(first_kv, first_kv + self.kv_heads)
        self.gated, bias = cfg.is_hybrid, cfg.attention_bias
        self.q_proj = ColumnLinear.even(h, heads * d * (2 if self.gated else 1), group, bias)
        self.k_proj = ColumnLinear(h, kv_heads * d, _rows(kv_heads_held, d), bias)
        self.v_proj = ColumnLinear(h, kv_heads * dv, _rows(kv_heads_held, dv), bias)
        self.v_scale = cfg.attention_value_scale  # MiMo: V scaled before it is cached
        self.o_proj = RowLinear(heads * dv, h, group, bias and cfg.is_gpt_oss)
        self.qk_norm = cfg.use_qk_norm  # GLM-4.5 may have none
        if self.qk_norm:
            offset = 1.0 if cfg.is_hybrid else 0.0
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, offset)
        self.rotary_dim = cfg.rotary_dim
        self.rotary = RotaryEmbedding(
            self.rotary_dim, cfg.rope_base(layer_id), scaling=cfg.rope_scaling
        )
        self.window = cfg.window(layer_id)
        self.sinks = None
        if cfg.has_sinks(layer_id):  # one learned logit per query head, cut like the heads
            self.sinks = nn.Parameter(torch.zeros(self.heads))
            set_shard(self.sinks, 0, group.rank * self.heads, heads)

    def kv_entries(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.kv_heads, self.head_dim), "v": (self.kv_heads, self.v_dim)}

    def prepare(self, ctx: ForwardContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(t, self.heads * self.head_dim)
        q = q.reshape(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(t, self.kv_heads, self.v_dim)
        if self.v_scale != 1.0:
            v = v * self.v_scale
        q, k = self._rotate(q, k, ctx)
        return (q, k, v) if gate is None else (q, k, v, gate)

    def _rotate(
        self, q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated as one tensor of ``heads + kv_heads`` heads: one rotation's kernels
        instead of two (each element's arithmetic is the same)."""
        x = torch.cat((q, k), dim=1)
        r = self.rotary_dim
        if r == self.head_dim:
            x = self.rotary(x, ctx)
        else:
            x = torch.cat((self.rotary(x[..., :r], ctx), x[..., r:]), dim=-1)
        return x[:, : self.heads], x[:, self.heads :]

    def core(
        self,
        ctx: ForwardContext,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan, cache, layer = attention_plan(ctx), ctx.kv_cache, self.layer_id
        bounds = ctx.position_end, ctx.slot_end
        cache.store(layer, plan.slots, ctx.positions, bounds, plan.pages, k=k, v=v)
        scale = self.head_dim**-0.5
        if self.window or self.sinks is not None:
            return self._output(self._windowed(ctx, plan, q, scale), gate)
        out = q.new_empty(q.shape[0], self.heads, self.v_dim)
        if plan.decode_max_len:
            q_dec = q if plan.all_decode else q[plan.decode_rows]
            if cache.read_in_place and self.v_dim == self.head_dim:
                dec = paged_decode(q_dec, cache, layer, plan, scale)
            else:
                keys = cache.gather(
                    layer, "k", plan.decode_slots, plan.decode_max_len, 0, plan.pages
                )
                values = cache.gather(
                    layer, "v", plan.decode_slots, plan.decode_max_len, 0, plan.pages
                )
                dec = decode_attention(q_dec, keys, values, plan.decode_mask(keys.shape[1]), scale)
            if plan.all_decode:
                out = dec
            else:
                out[plan.decode_rows] = dec
        for group in plan.extends:
            keys = cache.gather(layer, "k", group.slots, group.length, 0, plan.pages)
            values = cache.gather(layer, "v", group.slots, group.length, 0, plan.pages)
            q_group = q[group.rows].unflatten(0, (-1, group.new))
            attended = causal_attention(
                q_group, keys, values, group.prefix, scale, plan.causal_masks
            )
            out[group.rows] = attended.flatten(0, 1)
        return self._output(out, gate)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        out = out.reshape(out.shape[0], self.heads * self.v_dim)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _windowed(
        self, ctx: ForwardContext, plan: AttentionPlan, q: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Sink and window attention: each group reads only the keys its window reaches (the
        cache still holds the whole context)."""
        cache, layer, window, sinks = ctx.kv_cache, self.layer_id, self.window, self.sinks
        out = q.new_empty(q.shape[0], self.heads, self.v_dim)
        if plan.decode_max_len:
            start = first_key(plan.decode_min_len - 1, window)
            keys = cache.gather(
                layer, "k", plan.decode_slots, plan.decode_max_len, start, plan.pages
            )
            values = cache.gather(
                layer, "v", plan.decode_slots, plan.decode_max_len, start, plan.pages
            )
            q_dec = q if plan.all_decode else q[plan.decode_rows]
            lens = plan.decode_lens
            dec = window_decode(q_dec, keys, values, lens, start, scale, window, sinks)
            if plan.all_decode:
                return dec
            out[plan.decode_rows] = dec
        for group in plan.extends:
            start = first_key(group.prefix, window)
            keys = cache.gather(layer, "k", group.slots, group.length, start, plan.pages)
            values = cache.gather(layer, "v", group.slots, group.length, start, plan.pages)
            q_group = q[group.rows].unflatten(0, (-1, group.new))
            if window or sinks is None:
                attended = extend_attention(
                    q_group, keys, values, group.prefix, start, scale, window, sinks
                )
            else:  # a full layer with sinks: SDPA, the sink one more key
                attended = sink_attention(
                    q_group, keys, values, group.prefix, scale, sinks, plan.causal_masks
                )
            out[group.rows] = attended.flatten(0, 1)
        return out


def _rows(kv_heads: range, width: int) -> range:
    """The projection rows of KV heads ``kv_heads``, each ``width`` wide."""
    return range(kv_heads.start * width, kv_heads.stop * width)
