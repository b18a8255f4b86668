"""Runs one rank's forward pass: the model's operations over a ForwardBatch."""

from __future__ import annotations

import torch

from moe_overlap.engine.forward_batch import ForwardBatch
from moe_overlap.engine.kv_cache import KVCache
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.context import ForwardContext
from moe_overlap.overlap.operations import execute_operations


class ModelRunner:
    def __init__(self, model: MoeForCausalLM, dispatcher, num_slots: int, max_len: int):
        self.model = model
        self.dispatcher = dispatcher
        self.kv_cache = KVCache(model.cfg.num_hidden_layers, num_slots, max_len, model.kv_entries())
        self.ops = model.operations()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for the rows ``batch.logit_rows()`` names."""
        ctx = ForwardContext(batch, self.kv_cache, self.dispatcher)
        return execute_operations(ctx, self.ops)["logits"]
