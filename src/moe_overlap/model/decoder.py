"""A decoder layer whose forward is a list of named operations.

The model knows nothing about micro-batches or overlap: it exposes its work as ``op_*`` methods
that take a ``ForwardContext`` and the previous op's outputs, and the overlap engine decides how
to interleave them. Values that cross ops travel in ``ctx.state`` (put once, popped once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.layers import GatedMLP, RMSNorm
from moe_overlap.model.moe_block import SparseMoeBlock
from moe_overlap.model.tensor_parallel import ModelParallel

# the operations a layer has, in sequential order; overlap/strategy.py schedules them
MOE_OPS = (
    "prepare_attn",
    "attn_prepare",
    "attn_core",
    "prepare_mlp",
    "gate",
    "select_experts",
    "dispatch_a",
    "dispatch_b",
    "experts",
    "combine_a",
    "combine_b",
    "shared_experts",
    "output",
)
DENSE_OPS = ("prepare_attn", "attn_prepare", "attn_core", "prepare_mlp", "dense_mlp", "output")


class TokenMixer(Protocol):
    """What a decoder layer asks of its attention (GQA, MLA or Gated DeltaNet)."""

    def prepare(self, ctx: ForwardContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def core(self, ctx: ForwardContext, *parts: torch.Tensor) -> torch.Tensor: ...

    def kv_entries(self) -> dict[str, tuple[int, ...]]: ...

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]: ...


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        attn: nn.Module,
        par: ModelParallel | None = None,
    ):
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.is_linear = cfg.is_linear_layer(layer_id)
        if self.is_linear:  # the checkpoint's names: linear_attn or self_attn
            self.linear_attn = attn
        else:
            self.self_attn = attn
        offset = 1.0 if cfg.is_hybrid else 0.0  # Qwen3.5's norms are zero-centred
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        par = par or ModelParallel.single()
        self.mlp = (
            SparseMoeBlock(cfg, par, layer_id)
            if self.is_moe
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, par.attn_tp)
        )

    @property
    def attn(self) -> TokenMixer:
        """The token mixer: attention, or (Qwen3.5) a linear-attention layer."""
        return cast(TokenMixer, self.linear_attn if self.is_linear else self.self_attn)

    @property
    def op_names(self) -> tuple[str, ...]:
        if not self.is_moe:
            return DENSE_OPS
        if not self.mlp.has_shared:
            return tuple(n for n in MOE_OPS if n != "shared_experts")
        return MOE_OPS

    def op(self, name: str) -> Callable:
        """The bound operation called ``name`` (a strategy names ops; this resolves them)."""
        if name not in self.op_names:
            raise KeyError(
                f"layer {self.layer_id} has no operation {name!r}; it has {self.op_names}"
            )
        owner = self if hasattr(self, f"op_{name}") else self.mlp  # the MoE block's own ops
        return getattr(owner, f"op_{name}")

    def op_prepare_attn(
        self, ctx: ForwardContext, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        residual = hidden_states if residual is None else residual + hidden_states
        ctx.state.put(residual=residual, attn_in=self.input_layernorm(residual))

    def op_attn_prepare(self, ctx: ForwardContext) -> None:
        ctx.state.put(qkv=self.attn.prepare(ctx, ctx.state.pop("attn_in")))

    def op_attn_core(self, ctx: ForwardContext) -> None:
        ctx.state.put(attn_out=self.attn.core(ctx, *ctx.state.pop("qkv")))

    def op_prepare_mlp(self, ctx: ForwardContext) -> None:
        residual = ctx.state.pop("residual") + ctx.state.pop("attn_out")
        ctx.state.put(residual=residual, mlp_in=self.post_attention_layernorm(residual))

    def op_dense_mlp(self, ctx: ForwardContext) -> None:
        ctx.state.put(moe_out=self.mlp(ctx.state.pop("mlp_in")))

    def op_output(self, ctx: ForwardContext) -> dict[str, torch.Tensor]:
        s = ctx.state
        hidden = s.pop("moe_out")
        if "shared_out" in s:
            hidden = hidden + s.pop("shared_out")
        residual = s.pop("residual")
        s.assert_empty(f"layer {self.layer_id}")
        return {"hidden_states": hidden, "residual": residual}
