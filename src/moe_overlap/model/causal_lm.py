"""The causal LM for both families: embedding, decoder layers as operations, LM head."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.attention import GQAttention
from moe_overlap.model.decoder import DecoderLayer
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.mla import MLAttention


def attention_class(cfg: ModelConfig) -> type[nn.Module]:
    return MLAttention if cfg.is_deepseek else GQAttention


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, ep_rank: int, ep_size: int):
        super().__init__()
        attn = attention_class(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, attn(cfg, i), ep_rank, ep_size)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (``model.layers.N...``, ``lm_head``).

    Under expert parallelism each rank builds only its ``num_experts / ep_size`` experts.
    """

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        self.cfg = cfg
        self.model = _Backbone(cfg, ep_rank, ep_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def kv_entries(self) -> dict[str, tuple[int, ...]]:
        return attention_class(self.cfg).kv_entries(self.cfg)

    def op_embed(self, ctx: ForwardContext) -> dict:
        return {"hidden_states": self.model.embed_tokens(ctx.batch.input_ids), "residual": None}

    def op_logits(
        self, ctx: ForwardContext, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> dict:
        if residual is not None:
            hidden_states = residual + hidden_states
        rows = ctx.batch.logit_rows()
        return {"logits": self.lm_head(self.model.norm(hidden_states[rows])).float()}
