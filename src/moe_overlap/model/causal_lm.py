"""The causal LM for every family: embedding, decoder layers as operations, LM head."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.transfer import to_device
from moe_overlap.model.attention import GQAttention
from moe_overlap.model.decoder import DecoderLayer
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.linear_attention import GatedDeltaNet
from moe_overlap.model.mla import MLAttention
from moe_overlap.model.mtp import MtpLayer, share_lm_head, share_qwen3_5_parts
from moe_overlap.model.tensor_parallel import ModelParallel, VocabEmbedding, VocabHead


def attention_class(cfg: ModelConfig, layer_id: int = 0) -> type[nn.Module]:
    if cfg.is_linear_layer(layer_id):
        return GatedDeltaNet
    return MLAttention if cfg.is_deepseek else GQAttention


class _Backbone(nn.Module):
    """A pipeline stage's part: the embedding on the first stage, its own layers (keyed by
    global index, so the parameter names stay the checkpoint's), the norm on the last."""

    def __init__(self, cfg: ModelConfig, par: ModelParallel, layers: range, mtp: bool):
        super().__init__()
        mtp = mtp and cfg.num_nextn_predict_layers > 0
        # the MTP layers embed tokens too: a last stage after the first holds a copy (SGLang's
        # and vLLM's MTP module under PP), filled from the same checkpoint tensor
        if layers.start == 0 or (mtp and layers.stop == cfg.num_hidden_layers):
            self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, par.attn_tp)
        self.layers = nn.ModuleDict(
            {
                str(i): DecoderLayer(cfg, i, attention_class(cfg, i)(cfg, i, par.attn_tp), par)
                for i in layers
            }
        )
        if layers.stop == cfg.num_hidden_layers:
            for i in range(layers.stop, layers.stop + cfg.num_nextn_predict_layers * mtp):
                self.layers[str(i)] = MtpLayer(
                    cfg, i, attention_class(cfg, i)(cfg, i, par.attn_tp), par
                )
            offset = 1.0 if cfg.is_hybrid else 0.0
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)


class MoeForCausalLM(nn.Module):
    """Parameter names follow the Hugging Face checkpoints (``model.layers.N...``, ``lm_head``).

    ``par`` places this rank: attention, dense MLPs and the vocabulary split over its
    attention-TP group, ``num_experts / ep_size`` experts each cut to its moe-TP slice.
    ``mtp``: with the config's MTP layers (``num_nextn_predict_layers``: the MTP drafter's;
    without it a checkpoint that leaves them out loads).
    """

    def __init__(self, cfg: ModelConfig, par: ModelParallel | None = None, mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.par = par = par or ModelParallel.single()
        stage = par.layers or range(cfg.num_hidden_layers)
        self.is_first, self.is_last = stage.start == 0, stage.stop == cfg.num_hidden_layers
        self.model = _Backbone(cfg, par, stage, mtp)
        self.keep_hidden = False  # op_logits also returns every row's final hidden state
        if self.is_last:
            self.lm_head = VocabHead(cfg.hidden_size, cfg.vocab_size, par.attn_tp)
            if cfg.tie_word_embeddings and self.has_embedding:
                self.lm_head.weight = self.model.embed_tokens.weight
            if cfg.is_hybrid and self.mtp_layers:  # Qwen3.5's mtp.*: one head for all
                share_qwen3_5_parts(self.mtp_layers, self.lm_head)
            if cfg.is_mimo:  # MiMo-V2-Flash's MTP layers have no head of their own
                share_lm_head(self.mtp_layers, self.lm_head)

    @property
    def has_embedding(self) -> bool:
        """This stage holds the embedding: the first, or a last one with MTP layers."""
        return hasattr(self.model, "embed_tokens")

    @property
    def layers(self) -> list[DecoderLayer]:
        """This stage's decoder layers, in order."""
        return [
            layer
            for layer in self.model.layers.values()
            if isinstance(layer, DecoderLayer) and not isinstance(layer, MtpLayer)
        ]

    @property
    def mtp_layers(self) -> list[MtpLayer]:
        """The MTP layers after the last decoder layer (built with ``mtp``, on the last stage)."""
        return [layer for layer in self.model.layers.values() if isinstance(layer, MtpLayer)]

    def kv_entries(self) -> list[dict[str, tuple[int, ...]]]:
        """The KV cache's entries per token, per global layer: this stage's full-attention
        layers' (MiMo-V2-Flash's sliding and full layers differ); none for a linear-attention
        layer or another stage's, so the pool holds no pages for them."""
        full = {x.layer_id: x.attn.kv_entries() for x in self.layers if not x.is_linear}
        return [full.get(i, {}) for i in range(self.cfg.num_hidden_layers)]

    def state_shapes(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per linear-attention layer of this stage: its (conv, SSM) state shapes."""
        return {x.layer_id: x.attn.state_shapes() for x in self.layers if x.is_linear}

    def op_embed(self, ctx: ForwardContext) -> dict:
        return {"hidden_states": self.model.embed_tokens(ctx.input_ids), "residual": None}

    def op_logits(
        self, ctx: ForwardContext, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> dict:
        if residual is not None:
            hidden_states = residual + hidden_states
        normed = self.model.norm(hidden_states)
        rows = normed
        if not ctx.batch.every_row_is_a_logit_row:
            rows = normed[to_device(ctx.batch.logit_rows(), normed.device)]
        out = {"logits": self.lm_head(rows).float()}
        if self.keep_hidden:  # the MTP drafter's input, every row (runtime/mtp_drafter.py)
            out["hidden"] = normed
        return out
