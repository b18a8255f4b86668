"""The attention ops of a hybrid model (Qwen3.5-MoE): most layers are Gated DeltaNet linear
attention, whose cost is linear in the tokens and does not grow with the context."""

from __future__ import annotations

from typing import Protocol

from moe_overlap.core.model_flops import OpSizes
from moe_overlap.planner.cluster import Cluster
from moe_overlap.planner.inputs import ModelSpec
from moe_overlap.planner.work import Work


class OpCosts(Protocol):
    """What a hybrid layer's cost reads of ``costs.py: CostModel`` (which calls in here)."""

    spec: ModelSpec
    cluster: Cluster
    sizes: OpSizes

    def kernel_seconds(
        self,
        flops: float,
        weights: float,
        act: float,
        rate: float | None = None,
        rows: float = 0.0,
        groups: float = 1.0,
    ) -> float: ...


def linear_attention_seconds(costs: OpCosts, w: Work) -> tuple[float, float]:
    """One Gated DeltaNet layer's (attn_prepare, attn_core) seconds: its projections, each
    token's update and read of a ``[heads, dk, dv]`` state, and one read and one write of each
    sequence's float32 state, whatever its context."""
    s, act, t = costs.sizes, costs.cluster.activation_bytes, w.tokens
    h = costs.spec.cfg.hidden_size
    prep_w, out_w, state = s.linear_prepare, s.linear_output, s.linear_state
    prepare = costs.kernel_seconds(2 * t * prep_w, prep_w, 2 * t * h * act, rows=t)
    core = costs.kernel_seconds(
        2 * t * out_w + 2 * 3 * t * state,  # out_proj; decay, correct, read
        out_w,
        2 * t * h * act + 2 * w.pieces * state * 4,
        rows=t,
    )
    return prepare, core


def with_linear_layers(
    costs: OpCosts, w: Work, prepare: float, core: float, kv_per_key: float
) -> tuple[float, float, float]:
    """The full-attention layers' (prepare, core, KV bytes per key) averaged with the linear
    layers' over the model's layers (the simulator runs one cost per op for every layer)."""
    share = costs.sizes.full_share
    lin_prepare, lin_core = linear_attention_seconds(costs, w)
    return (
        share * prepare + (1 - share) * lin_prepare,
        share * core + (1 - share) * lin_core,
        share * kv_per_key,
    )
