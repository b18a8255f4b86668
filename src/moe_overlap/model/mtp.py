"""DeepSeek-V3's and GLM-4.5's multi-token-prediction (MTP) layer: the drafter of
``--speculative-algorithm EAGLE`` (``runtime/mtp_drafter.py`` runs it on the ranks).

The checkpoint keeps it at ``model.layers.{num_hidden_layers + i}``: ``enorm`` (the next
token's embedding), ``hnorm`` (the target's hidden state), ``eh_proj`` (``[2h -> h]`` over the
two concatenated, embedding first), then a whole decoder layer (attention and MoE, under the
usual names), then ``shared_head.norm`` and ``shared_head.head`` (the LM head; where the
checkpoint has none, the loader reads ``lm_head.weight``). The embedding is the main model's.

Row ``q`` of an MTP forward takes the target's final (normed) hidden state at position ``q``
and the embedding of the token at ``q + 1``, and its logits predict the token at ``q + 2``;
its own keys and values sit at position ``q`` in the drafter's KV cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.transfer import to_device
from moe_overlap.model.decoder import DecoderLayer
from moe_overlap.model.layers import RMSNorm
from moe_overlap.model.tensor_parallel import ModelParallel, VocabEmbedding, VocabHead


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ModelParallel):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = VocabHead(cfg.hidden_size, cfg.vocab_size, par.attn_tp)


class MtpLayer(DecoderLayer):
    """One MTP layer: a decoder layer with the projection in front and the head behind."""

    def __init__(self, cfg: ModelConfig, layer_id: int, attn: nn.Module, par: ModelParallel):
        super().__init__(cfg, layer_id, attn, par)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
