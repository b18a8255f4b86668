"""DeepSeek-V3's, GLM-4.5's, Qwen3.5's and MiMo-V2-Flash's multi-token-prediction (MTP) layer:
the drafter of ``--speculative-algorithm EAGLE`` (``runtime/mtp_drafter.py`` runs it on the
ranks).

The checkpoint keeps it at ``model.layers.{num_hidden_layers + i}``: ``enorm`` (the next
token's embedding), ``hnorm`` (the target's hidden state), ``eh_proj`` (``[2h -> h]`` over the
two concatenated, embedding first), then a whole decoder layer (attention and MoE, under the
usual names), then ``shared_head.norm`` and ``shared_head.head`` (the LM head; where the
checkpoint has none, the loader reads ``lm_head.weight``). The embedding is the main model's.

Qwen3.5 keeps the same computation under ``mtp.*`` (``mtp_num_hidden_layers``): ``mtp.fc``
(``eh_proj``, embedding first), ``mtp.pre_fc_norm_embedding`` (``enorm``),
``mtp.pre_fc_norm_hidden`` (``hnorm``), ``mtp.layers.{i}`` (a full-attention decoder layer with
the MoE), ``mtp.norm`` (``shared_head.norm``) and the main ``lm_head``; its norms are
zero-centred like the model's, and the projection, the norms and the head are one for all its
layers (``share_qwen3_5_parts``; ``qwen3_5_name`` maps our names to the checkpoint's).

MiMo-V2-Flash keeps each MTP layer whole under ``model.mtp.layers.{i}``: ``enorm``, ``hnorm``,
``eh_proj``, a sliding-window decoder layer (its sinks, KV heads and RoPE base) with a dense MLP
(``intermediate_size``), whose post-attention norm is ``pre_mlp_layernorm``, and its own
``final_layernorm`` (``shared_head.norm``) before the model's ``lm_head`` (``mimo_name``).

Row ``q`` of an MTP forward takes the target's final (normed) hidden state at position ``q``
and the embedding of the token at ``q + 1``, and its logits predict the token at ``q + 2``;
its own keys and values sit at position ``q`` in the rank's paged KV cache, as layer
``num_hidden_layers + i`` on the sequence's pages (``model/caches.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.transfer import to_device
from moe_overlap.model.decoder import DecoderLayer
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.tensor_parallel import ModelParallel, VocabEmbedding, VocabHead

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
# Qwen3.5's checkpoint names of the parts around its MTP decoder layers, one for all of them
_QWEN3_5_PARTS = {
    "eh_proj.": "mtp.fc.",
    "enorm.": "mtp.pre_fc_norm_embedding.",
    "hnorm.": "mtp.pre_fc_norm_hidden.",
    "shared_head.norm.": "mtp.norm.",
    "shared_head.head.": "lm_head.",
}

# MiMo-V2-Flash's checkpoint names of parts of each MTP layer (``model.mtp.layers.{i}.``)
_MIMO_PARTS = {
    "post_attention_layernorm.": "pre_mlp_layernorm.",
    "shared_head.norm.": "final_layernorm.",
}


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ModelParallel):
        super().__init__()
        offset = 1.0 if cfg.is_hybrid else 0.0  # Qwen3.5's norms are zero-centred
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.head = VocabHead(cfg.hidden_size, cfg.vocab_size, par.attn_tp)


class MtpLayer(DecoderLayer):
    """One MTP layer: a decoder layer with the projection in front and the head behind."""

    def __init__(self, cfg: ModelConfig, layer_id: int, attn: nn.Module, par: ModelParallel):
        super().__init__(cfg, layer_id, attn, par)
        offset = 1.0 if cfg.is_hybrid else 0.0
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg, par)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input: ``eh_proj([enorm(embedding); hnorm(hidden)])``."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def mtp_ops(self, embed: VocabEmbedding) -> list[Callable]:
        """The layer's forward as ops (``overlap/operations.py: execute_operations`` runs them
        in order, unsplit): projection, the decoder layer's ops, the head. The first takes
        ``hidden`` (the target's, or the previous MTP step's, per row); the last returns
        ``logits`` (the batch's logit rows) and ``hidden`` (every row, normed)."""

        def op_project(ctx: ForwardContext, hidden: torch.Tensor) -> dict:
            x = self.project(embed(ctx.input_ids), hidden)
            return {"hidden_states": x, "residual": None}

        def op_head(
            ctx: ForwardContext, hidden_states: torch.Tensor, residual: torch.Tensor
        ) -> dict:
            normed = self.shared_head.norm(residual + hidden_states)
            rows = normed
            if not ctx.batch.every_row_is_a_logit_row:
                rows = normed[to_device(ctx.batch.logit_rows(), normed.device)]
            return {"logits": self.shared_head.head(rows).float(), "hidden": normed}

        return [op_project, *(self.op(name) for name in self.op_names), op_head]


def share_lm_head(layers: list[MtpLayer], lm_head: VocabHead) -> None:
    """MTP layers without a head of their own (Qwen3.5's, MiMo-V2-Flash's) use the model's."""
    for layer in layers:
        layer.shared_head.head = lm_head


def share_qwen3_5_parts(layers: list[MtpLayer], lm_head: VocabHead) -> None:
    """Qwen3.5's MTP layers share one ``mtp.fc``, one pair of pre-fc norms, one ``mtp.norm``
    and the model's LM head: every layer takes the first one's modules and ``lm_head``."""
    share_lm_head(layers, lm_head)
    for layer in layers:
        for name in ("eh_proj", "enorm", "hnorm"):
            setattr(layer, name, getattr(layers[0], name))
        layer.shared_head.norm = layers[0].shared_head.norm


def qwen3_5_name(name: str, first: int) -> str:
    """The Qwen3.5 checkpoint's name of parameter ``name`` (``first``: the first MTP layer's
    index, i.e. ``num_hidden_layers``): ``model.layers.{first + i}.X`` is ``mtp.layers.{i}.X``,
    or ``mtp.fc``, ``mtp.norm``, ... for the parts around it; other names are unchanged."""
    match = _LAYER.fullmatch(name)
    if match is None or int(match[1]) < first:
        return name
    rest = match[2]
    for ours, theirs in _QWEN3_5_PARTS.items():
        if rest.startswith(ours):
            return theirs + rest.removeprefix(ours)
    return f"mtp.layers.{int(match[1]) - first}.{rest}"


def mimo_name(name: str, first: int) -> str:
    """The MiMo-V2-Flash checkpoint's name of parameter ``name`` (``first``: the first MTP
    layer's index, ``num_hidden_layers``): ``model.layers.{first + i}.X`` is
    ``model.mtp.layers.{i}.X``, with ``pre_mlp_layernorm`` and ``final_layernorm`` for its
    post-attention and head norms, and its head the model's ``lm_head``; other names are
    unchanged."""
    match = _LAYER.fullmatch(name)
    if match is None or int(match[1]) < first:
        return name
    rest = match[2]
    if rest.startswith("shared_head.head."):
        return "lm_head." + rest.removeprefix("shared_head.head.")
    for ours, theirs in _MIMO_PARTS.items():
        if rest.startswith(ours):
            rest = theirs + rest.removeprefix(ours)
    return f"model.mtp.layers.{int(match[1]) - first}.{rest}"
