"""Runs one rank's forward pass: the model's operations over a ForwardBatch."""

from __future__ import annotations

import torch

from moe_overlap.config import OverlapConfig
from moe_overlap.engine.forward_batch import ForwardBatch
from moe_overlap.engine.kv_cache import KVCache
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.context import ForwardContext
from moe_overlap.overlap.operations import execute_operations


class ModelRunner:
    def __init__(
        self,
        model: MoeForCausalLM,
        dispatcher,
        num_slots: int,
        max_len: int,
        overlap: OverlapConfig | None = None,
        group=None,
    ):
        self.model = model
        self.dispatcher = dispatcher
        self.kv_cache = KVCache(model.cfg.num_hidden_layers, num_slots, max_len, model.kv_entries())
        self.ops = model.operations()
        self.overlap = None
        overlap = overlap or OverlapConfig(mode="none")
        if overlap.mode == "tbo":
            from moe_overlap.overlap.two_batch import TwoBatchOverlap

            self.overlap = TwoBatchOverlap(model, overlap, group)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for the rows ``batch.logit_rows()`` names."""
        if self.overlap is not None:
            logits = self.overlap.forward(batch, self.kv_cache, self.dispatcher)
            if logits is not None:
                return logits
        ctx = ForwardContext(batch, self.kv_cache, self.dispatcher)
        return execute_operations(ctx, self.ops)["logits"]
