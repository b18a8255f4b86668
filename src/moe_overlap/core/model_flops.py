"""The one cost model of a model's ops: how many weights each op multiplies a token by (its
FLOPs are twice that), what attention costs per query-key pair, and what a cached key holds.

Every estimate in the project starts here: the time-balanced split and ``auto``'s prediction
(``ModelFlops``: a forward's FLOPs by token and context), and the planner's op times
(``planner/costs.py`` turns these sizes into seconds on a cluster). Attention comes in three
kinds: full attention (GQA or DeepSeek's MLA), whose pairs grow with the context; Gated DeltaNet
linear attention (Qwen3.5), linear in the tokens, with a fixed-size state per sequence; and the
share of a hybrid model's layers that are each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.model_config import ModelConfig


@dataclass(frozen=True)
class OpSizes:
    """Per token and per layer, over ``tp`` attention-TP ranks (each holds 1/tp of the heads,
    the dense MLPs and the vocabulary)."""

    attn_prepare: float  # q, k, v projections (MLA: q's LoRA and the compressed KV)
    attn_output: float  # the output projection
    attn_up: float  # MLA: one key decompressed (prefill), or one query absorbed (decode)
    pair_flops: float  # FLOPs per query-key pair over this rank's heads (MLA: MHA form)
    decode_pair_flops: float  # the same, all-decode (MLA: the absorbed MQA form)
    kv_elements: float  # cached elements per key on this rank
    linear_prepare: float  # Gated DeltaNet: its input projections
    linear_output: float  # its output projection
    linear_state: float  # elements of one sequence's recurrent state
    full_share: float  # of the layers: softmax attention (1.0 without linear attention)
    sliding_share: float  # of the layers: sliding-window attention (GPT-OSS), within full_share
    window: int  # keys a sliding layer's query sees (its pairs and KV reads stop growing there)
    gate: float  # the router
    expert: float  # one routed expert (gate, up and down projections)
    shared: float  # every shared expert of a MoE layer
    dense: float  # a dense layer's MLP
    logits: float  # the LM head
    top_k: int


def linear_split(cfg: ModelConfig, attn_tp: int) -> int:
    """The ranks a linear-attention layer's heads are split over under attention TP
    ``attn_tp``: all of them where both head counts divide, else 1 (the layer replicated)."""
    heads = (cfg.linear_num_key_heads, cfg.linear_num_value_heads)
    return attn_tp if all(h % attn_tp == 0 for h in heads) else 1


def op_sizes(cfg: ModelConfig, tp: int = 1) -> OpSizes:
    h, heads = cfg.hidden_size, cfg.num_attention_heads / tp
    kv: float  # cached elements per key
    if cfg.is_deepseek:
        qk, v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        lora, rope, q_lora = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank
        q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
        prepare, output = q + h * (lora + rope), heads * v * h
        up = lora * heads * (cfg.qk_nope_head_dim + v)
        pair, decode_pair, kv = 2 * heads * (qk + v), 2 * heads * (2 * lora + rope), lora + rope
    else:
        d, dv = cfg.head_size, cfg.value_head_size  # MiMo: V heads narrower than Q/K heads
        queries = 2 * heads if cfg.is_hybrid else heads  # Qwen3.5: each head's output gate too
        n = cfg.num_hidden_layers  # MiMo's sliding layers have more KV heads: their average
        kv_heads = sum(cfg.kv_heads(i) for i in range(n)) / n / tp
        prepare = h * (queries * d + kv_heads * (d + dv))
        output, up = heads * dv * h, 0.0
        pair = decode_pair = 2 * heads * (d + dv)
        kv = kv_heads * (d + dv)
    layers = cfg.num_hidden_layers
    linear = sum(cfg.is_linear_layer(i) for i in range(layers))
    sliding = sum(cfg.window(i) > 0 for i in range(layers))
    split = linear_split(cfg, int(tp)) if linear else 1  # its heads over attention TP, or none
    value_heads = cfg.linear_num_value_heads / split
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim / split
    value_dim = value_heads * cfg.linear_value_head_dim
    expert = 3 * h * cfg.moe_intermediate_size
    return OpSizes(
        attn_prepare=prepare,
        attn_output=output,
        attn_up=up,
        pair_flops=pair,
        decode_pair_flops=decode_pair,
        kv_elements=kv,
        linear_prepare=h * (2 * key_dim + 2 * value_dim + 2 * value_heads) if linear else 0,
        linear_output=value_dim * h if linear else 0,
        linear_state=value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim,
        full_share=(layers - linear) / layers,
        sliding_share=sliding / layers,
        window=cfg.sliding_window if sliding else 0,
        gate=h * cfg.num_experts,
        expert=expert,
        # DeepSeek's shared experts are routed-expert wide; Qwen3.5's one has its own width
        shared=expert * cfg.n_shared_experts + 3 * h * cfg.shared_expert_intermediate_size,
        dense=3 * h * cfg.intermediate_size / tp,
        logits=h * cfg.vocab_size / tp,
        top_k=cfg.num_experts_per_tok,
    )


class Piece(Protocol):
    """A run of one sequence's new tokens (``overlap/split.py``'s pieces)."""

    @property
    def seq(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def length(self) -> int: ...


@dataclass(frozen=True)
class ModelFlops:
    """A MoE layer's FLOPs for a micro-batch: ``per_token`` for every token (projections,
    routed and shared experts; a linear-attention layer's state update) plus ``per_pair`` for
    every query-key pair of full attention (a later chunk of a cut sequence attends over the
    earlier one, so equal tokens are not equal time), and ``window_pair`` for each of a sliding
    layer's pairs, at most ``window`` per token."""

    per_token: float
    per_pair: float
    expert_share: float  # of ``per_token``: the routed experts
    shared_share: float  # of ``per_token``: the shared experts
    window_pair: float = 0.0
    window: int = 0

    @classmethod
    def for_model(cls, cfg: ModelConfig) -> ModelFlops:
        s = op_sizes(cfg)
        full = s.attn_prepare + s.attn_output + s.attn_up
        linear = s.linear_prepare + s.linear_output + 3 * s.linear_state
        attention = s.full_share * full + (1 - s.full_share) * linear
        routed = s.top_k * s.expert
        per_token = 2.0 * (attention + routed + s.shared)
        return cls(
            per_token=per_token,
            per_pair=(s.full_share - s.sliding_share) * s.pair_flops,
            expert_share=2.0 * routed / per_token,
            shared_share=2.0 * s.shared / per_token,
            window_pair=s.sliding_share * s.pair_flops,
            window=s.window,
        )

    def cost(self, batch: ForwardBatch, child: Sequence[Piece]) -> float:
        """FLOPs of the pieces ``child`` of ``batch``."""
        total = 0.0
        for p in child:
            prefix = batch.prefix_lens[p.seq] + p.start
            total += self.per_token * p.length + self.per_pair * p.length * (
                prefix + (p.length + 1) / 2
            )
            if self.window_pair:
                seen = torch.arange(prefix + 1, prefix + p.length + 1).clamp(max=self.window)
                total += self.window_pair * float(seen.sum())
        return total

    def token_costs(self, batch: ForwardBatch) -> torch.Tensor:
        """The FLOPs of each new token: a token at position p attends to p + 1 keys (at most
        ``window`` in a sliding layer)."""
        keys = batch.positions.double() + 1
        costs = self.per_token + self.per_pair * keys
        return costs + self.window_pair * keys.clamp(max=self.window) if self.window else costs
