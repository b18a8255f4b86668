"""Every scheme's schedule as data: the op order of a layer, where it yields, and the stage lag.

One table, ``STRATEGIES``, keyed by (scheme, family, phase), holds the plain order (no overlap),
SGLang's TBO orders, SGLang's SBO order and vLLM's DBO order. One builder,
``build_operations``, resolves a strategy's names on each layer, so a new model or schedule is
a new entry (or a Strategy passed in), never an engine change. A scheme may bring its own ops by
name (``SchemeOp``), each standing for some of the layer's ops. Layers without shared experts
(Qwen3) skip ``shared_experts``; dense layers run their dense ops without yields.

What a yield means is the scheme's: a stage boundary for TBO's stage executor; for DBO's baton
threads the point, right after launching an all-to-all, where the other micro-batch takes over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from moe_overlap.core import overlap_modes as modes
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.decoder import DENSE_OPS
from moe_overlap.overlap.operations import YIELD, Op, Yield

Y = "|"  # a yield in a strategy's op list
OPTIONAL_OPS = frozenset({"shared_experts"})  # a layer that lacks one skips it
FAMILIES = ("deepseek", "qwen3")  # every order is the same for both


def parse_ops(text: str) -> tuple[str, ...]:
    """``"a b | c"`` -> ``("a", "b", "|", "c")``."""
    return tuple(text.replace(Y, f" {Y} ").split())


@dataclass(frozen=True)
class Strategy:
    name: str
    moe_ops: tuple[str, ...]  # op names of one MoE layer, "|" where a yield goes
    delta_stages: int = 0  # TBO: micro-batch i starts this many stages after i - 1
    dense_ops: tuple[str, ...] = DENSE_OPS

    def __post_init__(self) -> None:
        if self.delta_stages < 0:
            raise ValueError(f"strategy {self.name}: delta_stages must be >= 0")
        if Y in self.dense_ops:  # a dense layer has no all-to-all to hide
            raise ValueError(f"strategy {self.name}: dense layers do not yield")


class StagedLayer(Protocol):
    """What the builder reads of a layer: the real ``DecoderLayer`` and the planner's
    simulated layer both have it."""

    @property
    def layer_id(self) -> int: ...
    @property
    def is_moe(self) -> bool: ...
    @property
    def op_names(self) -> tuple[str, ...]: ...
    def op(self, name: str) -> Op: ...


L = TypeVar("L", bound=StagedLayer)
L_co = TypeVar("L_co", bound=StagedLayer, covariant=True)


class StagedModel(Protocol[L_co]):
    """What the builder reads of a model (``MoeForCausalLM``, or the planner's ``SimModel``)."""

    @property
    def cfg(self) -> ModelConfig: ...
    @property
    def layers(self) -> Sequence[L_co]: ...
    @property
    def op_embed(self) -> Op: ...
    @property
    def op_logits(self) -> Op: ...


@dataclass(frozen=True)
class SchemeOp(Generic[L]):
    """A scheme's own op: ``make(layer)`` builds it; it stands for the layer's ops ``covers``."""

    covers: tuple[str, ...]
    make: Callable[[L], Op]


_ATTN = "prepare_attn attn_prepare attn_core prepare_mlp gate select_experts"
PLAIN = Strategy(
    "plain",
    parse_ops(f"{_ATTN} dispatch_a dispatch_b experts combine_a combine_b shared_experts output"),
)
# SGLang's operations_strategy.py (DeepSeek; Qwen3 is the same without shared experts)
TBO_PREFILL = Strategy(
    "tbo-prefill",
    parse_ops(
        f"{_ATTN} dispatch_a | dispatch_b experts combine_a | shared_experts combine_b output"
    ),
)
TBO_DECODE = Strategy(
    "tbo-decode",
    parse_ops(
        "prepare_attn attn_prepare | attn_core prepare_mlp gate select_experts |"
        " dispatch_a shared_experts | dispatch_b experts combine_a | combine_b | output"
    ),
    delta_stages=2,
)
# SGLang's SBO: shared experts hide the dispatch; "experts_combine_a" is SBO's own op
SBO = Strategy(
    modes.SBO.name,
    parse_ops(f"{_ATTN} dispatch_a shared_experts dispatch_b experts_combine_a combine_b output"),
)
# vLLM's modular kernel: shared experts run between the combine's send and its receive
DBO = Strategy(
    modes.DBO.name,
    parse_ops(
        f"{_ATTN} dispatch_a | dispatch_b experts combine_a shared_experts | combine_b output"
    ),
)
# SGLang's MiMoV2 TBO (``_compute_moe_mimov2_layer_operations_strategy_tbo``): no shared
# experts; prefill cuts where DeepSeek's does; decode gives dispatch_a a stage of its own and
# ends each layer with combine_b and output in one stage, then a yield
MIMO_TBO_PREFILL = Strategy(
    "mimo-tbo-prefill",
    parse_ops(f"{_ATTN} dispatch_a | dispatch_b experts combine_a | combine_b output"),
)
MIMO_TBO_DECODE = Strategy(
    "mimo-tbo-decode",
    parse_ops(
        "prepare_attn attn_prepare | attn_core prepare_mlp gate select_experts |"
        " dispatch_a | dispatch_b experts combine_a | combine_b output |"
    ),
    delta_stages=2,
)
_BY_SCHEME = {
    modes.NONE.name: {"prefill": PLAIN, "decode": PLAIN},
    modes.TBO.name: {"prefill": TBO_PREFILL, "decode": TBO_DECODE},  # MIXED batches use prefill's
    modes.SBO.name: {"prefill": SBO, "decode": SBO},
    modes.DBO.name: {"prefill": DBO, "decode": DBO},
}
STRATEGIES: dict[tuple[str, str, str], Strategy] = {
    (scheme, family, phase): strategy
    for scheme, phases in _BY_SCHEME.items()
    for phase, strategy in phases.items()
    for family in FAMILIES
} | {
    (modes.TBO.name, "mimo_v2_flash", "prefill"): MIMO_TBO_PREFILL,
    (modes.TBO.name, "mimo_v2_flash", "decode"): MIMO_TBO_DECODE,
}


def strategy_for(
    model: StagedModel,
    scheme: str,
    decode: bool = False,
    strategies: Mapping[tuple[str, str, str], Strategy] | None = None,
) -> Strategy:
    """The strategy for this scheme, model and phase. ``strategies`` (keys as in STRATEGIES,
    the model_type also accepted as family) overrides the built-in ones."""
    phase = "decode" if decode else "prefill"
    family = "deepseek" if model.cfg.is_deepseek else "qwen3"
    for table in (strategies or {}, STRATEGIES):
        for key in ((scheme, model.cfg.model_type, phase), (scheme, family, phase)):
            if key in table:
                return table[key]
    raise KeyError(f"no {scheme} strategy for {model.cfg.model_type} {phase}")


def layer_operations(
    layer: L, strategy: Strategy, own: Mapping[str, SchemeOp[L]] | None = None
) -> list[Op | Yield]:
    """``layer``'s ops in ``strategy``'s order, checked to cover exactly the layer's own ops."""
    own = own or {}
    names = strategy.moe_ops if layer.is_moe else strategy.dense_ops
    names = tuple(n for n in names if n not in OPTIONAL_OPS or n in layer.op_names)
    covered = sorted(op for n in names if n != Y for op in (own[n].covers if n in own else (n,)))
    if covered != sorted(layer.op_names):
        raise ValueError(
            f"strategy {strategy.name} covers ops {covered}, but layer {layer.layer_id} has "
            f"{sorted(layer.op_names)}"
        )
    return [YIELD if n == Y else own[n].make(layer) if n in own else layer.op(n) for n in names]


def build_operations(
    model: StagedModel[L],
    strategy: Strategy,
    own: Mapping[str, SchemeOp[L]] | None = None,
    layers: range | None = None,
) -> list[Op | Yield]:
    """The whole forward (of this pipeline stage, or of ``layers`` only) as ops with yields: the
    embedding before layer 0, each layer per the strategy, the logits after the last layer (an
    earlier part ends with its last layer's ``hidden_states`` and ``residual``, which the next
    part starts from)."""
    chosen = [x for x in model.layers if layers is None or x.layer_id in layers]
    ops: list[Op | Yield] = [model.op_embed] if chosen[0].layer_id == 0 else []
    for layer in chosen:
        ops += layer_operations(layer, strategy, own)
    last = chosen[-1].layer_id == model.cfg.num_hidden_layers - 1
    return ops + [model.op_logits] if last else ops
