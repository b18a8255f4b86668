"""Overlap strategies as data: the op order of a layer with yields, and the stage lag.

A strategy names operations; ``build_operations`` resolves the names on each layer, so a new
model needs only a new entry in ``STRATEGIES`` (or a Strategy passed in), never an engine change.
Dense layers run their ops without yields: they have no all-to-all to hide.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.decoder import DENSE_OPS
from moe_overlap.overlap.operations import YIELD, Op, Yield

Y = "|"  # a yield in a strategy's op list


@dataclass(frozen=True)
class Strategy:
    name: str
    moe_ops: tuple[str, ...]  # op names of one MoE layer, "|" where a yield goes
    delta_stages: int
    dense_ops: tuple[str, ...] = DENSE_OPS


def _ops(text: str) -> tuple[str, ...]:
    return tuple(text.replace("|", " | ").split())


# SGLang's orders (reference 002, DESIGN.md s5); MIXED batches use the prefill order.
STRATEGIES: dict[tuple[str, str], Strategy] = {
    ("deepseek", "prefill"): Strategy(
        "deepseek-prefill",
        _ops(
            "prepare_attn attn_prepare attn_core prepare_mlp gate select_experts dispatch_a |"
            " dispatch_b experts combine_a | shared_experts combine_b output"
        ),
        0,
    ),
    ("deepseek", "decode"): Strategy(
        "deepseek-decode",
        _ops(
            "prepare_attn attn_prepare | attn_core prepare_mlp gate select_experts |"
            " dispatch_a shared_experts | dispatch_b experts combine_a | combine_b | output"
        ),
        2,
    ),
    ("qwen3", "prefill"): Strategy(
        "qwen3-prefill",
        _ops(
            "prepare_attn attn_prepare attn_core prepare_mlp gate select_experts dispatch_a |"
            " dispatch_b experts combine_a | combine_b output"
        ),
        0,
    ),
    ("qwen3", "decode"): Strategy(
        "qwen3-decode",
        _ops(
            "prepare_attn attn_prepare | attn_core prepare_mlp gate select_experts | dispatch_a |"
            " dispatch_b experts combine_a | combine_b | output"
        ),
        2,
    ),
}


def strategy_for(
    model: MoeForCausalLM, decode: bool, strategies: dict[tuple[str, str], Strategy] | None = None
) -> Strategy:
    """The strategy for this model and phase; ``strategies`` (same keys as STRATEGIES, the
    model_type also accepted as family) overrides the built-in ones."""
    phase = "decode" if decode else "prefill"
    family = "deepseek" if model.cfg.is_deepseek else "qwen3"
    for table in (strategies or {}, STRATEGIES):
        for key in ((model.cfg.model_type, phase), (family, phase)):
            if key in table:
                return table[key]
    raise KeyError(f"no overlap strategy for {model.cfg.model_type} {phase}")


def build_operations(model: MoeForCausalLM, strategy: Strategy) -> list[Op | Yield]:
    """The whole forward as ops with yields: embed, each layer per the strategy, logits."""
    ops: list[Op | Yield] = [model.op_embed]
    for layer in model.layers:
        names = strategy.moe_ops if layer.is_moe else strategy.dense_ops
        listed = sorted(n for n in names if n != Y)
        if listed != sorted(layer.op_names):
            raise ValueError(
                f"strategy {strategy.name} lists ops {listed}, but layer "
                f"{layer.layer_id} has {sorted(layer.op_names)}"
            )
        ops += [YIELD if name == Y else layer.op(name) for name in names]
    return ops + [model.op_logits]
