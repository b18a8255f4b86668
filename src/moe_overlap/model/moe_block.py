"""The MoE block: router, this rank's experts and shared experts, exposed as operations."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.layers import GatedMLP
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.replicas import ReplicaMap
from moe_overlap.model.router import Router
from moe_overlap.model.tensor_parallel import ColumnLinear, ModelParallel, even_part


class SparseMoeBlock(nn.Module):
    """Router, this rank's experts and shared experts (DeepSeek's, or Qwen3.5's gated one),
    exposed as operations."""

    routed: torch.Tensor  # [physical slots]: rows sent to each while ``record``
    window: torch.Tensor  # [experts]: tokens routed to each logical expert (online EPLB)

    def __init__(self, cfg: ModelConfig, par: ModelParallel | None = None, layer_id: int = 0):
        super().__init__()
        par = par or ModelParallel.single()
        # EPLB: this layer's physical slots, each a copy of a logical expert, and the map from a
        # routed (logical) expert to the slot that serves it
        slots = par.placement.row(layer_id) if par.placement else tuple(range(cfg.num_experts))
        local = len(slots) // par.ep_size
        first = par.ep_rank * local
        self.slots = slots  # the logical expert of every physical slot, on every rank
        self.gate = Router(cfg)
        self.replicas = None
        if par.placement is not None:
            dynamic = par.placement.dispatch == "dynamic"
            self.replicas = ReplicaMap(slots, par.ep_rank, par.ep_size, dynamic)
        self.experts = ExpertBank(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            first,
            local,
            even_part(cfg.moe_intermediate_size, par.moe_tp_rank, par.moe_tp_size),
            (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.is_gpt_oss else None,
            slots[first : first + local],
        )
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, par.attn_tp
            )
        elif cfg.shared_expert_intermediate_size:  # Qwen3.5: one shared expert, gated per token
            self.shared_expert = GatedMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, par.attn_tp
            )
            self.shared_expert_gate = ColumnLinear(cfg.hidden_size, 1, range(1))
        self.has_shared = cfg.n_shared_experts > 0 or cfg.shared_expert_intermediate_size > 0
        # the expert-distribution recorder: rows this rank sent each physical slot, kept on the
        # device (read only when asked, ``runtime/expert_load.py``)
        self.record, self.layer_id = False, layer_id
        self.register_buffer("routed", torch.zeros(len(slots), dtype=torch.long), persistent=False)
        # online EPLB's window: routed tokens per logical expert since the last rebalance
        self.online = par.placement is not None and par.placement.online is not None
        self.register_buffer(
            "window", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False
        )

    def op_gate(self, ctx: ForwardContext) -> None:
        ctx.state.put(router_logits=self.gate.logits(ctx.state.get("mlp_in")))

    def op_select_experts(self, ctx: ForwardContext) -> None:
        ids, weights = self.gate.select(ctx.state.pop("router_logits"))
        ctx.state.put(topk_ids=ids, topk_weights=weights)

    def op_dispatch_a(self, ctx: ForwardContext) -> None:
        s = ctx.state
        x = s.get("mlp_in") if self.has_shared else s.pop("mlp_in")
        ids, weights = s.pop("topk_ids"), s.pop("topk_weights")
        if self.online:
            flat = ids.reshape(-1).long()
            self.window.index_add_(0, flat, torch.ones_like(flat))
        if self.replicas is not None:
            ids = self.replicas(ids)  # logical experts to the physical slots that serve them
        if self.record:
            flat = ids.reshape(-1).long()
            self.routed.index_add_(0, flat, torch.ones_like(flat))
        extend = not all(ctx.batch.is_decode)  # padding rules differ for prefill and decode
        s.put(dispatch=ctx.dispatcher.dispatch_a(x, ids, weights, owner=ctx.name, extend=extend))

    def op_dispatch_b(self, ctx: ForwardContext) -> None:
        ctx.dispatcher.dispatch_b(ctx.state.get("dispatch"))

    def op_experts(self, ctx: ForwardContext) -> None:
        d = ctx.state.get("dispatch")
        d.expert_outputs = self.experts.run_dispatched(d)

    def op_combine_a(self, ctx: ForwardContext) -> None:
        ctx.dispatcher.combine_a(ctx.state.get("dispatch"))

    def op_combine_b(self, ctx: ForwardContext) -> None:
        ctx.state.put(moe_out=ctx.dispatcher.combine_b(ctx.state.pop("dispatch")))

    def op_shared_experts(self, ctx: ForwardContext) -> None:
        x = ctx.state.pop("mlp_in")
        if self.shared_experts is not None:
            ctx.state.put(shared_out=self.shared_experts(x))
            return
        gate = torch.sigmoid(self.shared_expert_gate(x))
        ctx.state.put(shared_out=gate * self.shared_expert(x))


def skew_routing(model: nn.Module, exponent: float, seed: int) -> None:
    """``--expert-skew zipf:S``: in each MoE layer, the expert of rank r (a seeded order per
    layer, the same on every rank) gets ``-S * ln(r + 1)`` added to its router logit, so a
    softmax router picks it with odds falling as ``1 / (r + 1) ** S``."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = block.gate.weight.shape[0]
            gen = torch.Generator().manual_seed(seed * 1009 + block.layer_id)
            order = torch.randperm(experts, generator=gen)
            skew = torch.empty(experts)
            skew[order] = -exponent * torch.arange(1, experts + 1, dtype=torch.float32).log()
            block.gate.set_skew(skew.to(block.gate.weight.device))
