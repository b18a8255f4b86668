"""``--moe-a2a-backend``: which dispatcher a rank builds for its layout."""

from __future__ import annotations

from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.timeline import Timeline
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.fp8_rows import PlainRows
from moe_overlap.dispatch.gather import GatherDispatcher
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.dispatch.low_latency import LowLatencyDispatcher
from moe_overlap.dispatch.scatter import ScatteredDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.layout import RankCoords
from moe_overlap.distributed.modelled_link import ModelledLink


def resolve_backend(backend: str, par: ParallelConfig) -> str:
    """``auto``: ``local`` where a pipeline stage is one rank (one process, or ``--pp`` with
    ``--tp 1``: a stage's MoE layers hold every expert); ``torch`` (all-to-all) when every rank
    of the TP world owns whole experts (``ep == tp``, moe-TP 1); else ``none``, SGLang's
    tensor-parallel MoE (gather, partial experts, all-reduce). An explicit choice is taken as
    given (``core/layout_rules.py`` refused one the layout cannot run)."""
    if par.stage_size == 1:  # no MoE layer spans two processes
        return Backend.LOCAL
    if backend == Backend.AUTO:
        return Backend.TORCH if par.moe_tp == 1 else Backend.NONE
    return backend


def make_dispatcher(
    backend: str,
    num_experts: int,
    par: ParallelConfig,
    groups: dict[str, Group],
    coords: RankCoords,
    link: ModelledLink | None = None,
    timeline: Timeline | None = None,
    wire: PlainRows | None = None,
) -> Dispatcher:
    """``wire``: the dispatched rows' form (``--moe-dispatch-dtype``; None: as they are)."""
    kind = resolve_backend(backend, par)
    if kind == Backend.LOCAL:
        return LocalDispatcher(num_experts, wire)
    if kind == Backend.NONE:
        return GatherDispatcher(
            groups["tp"],
            groups["attn_dp"],
            coords.attn_tp_rank,
            coords.ep_rank,
            par.ep,
            num_experts,
            link,
            timeline,
            wire,
        )
    a2a = AllToAllDispatcher(groups["ep"], num_experts, link, timeline, wire)
    return ScatteredDispatcher(a2a, groups["attn_tp"]) if par.attn_tp > 1 else a2a


def has_low_latency_form(dispatcher: Dispatcher) -> bool:
    """Whether ``dispatcher`` can send fixed-capacity blocks: the all-to-all, alone or with
    each attention-TP rank sending its share of the group's tokens (``ScatteredDispatcher``)."""
    inner = dispatcher.inner if isinstance(dispatcher, ScatteredDispatcher) else dispatcher
    return isinstance(inner, AllToAllDispatcher)


def low_latency_form(dispatcher: Dispatcher, capacity: int) -> Dispatcher:
    """``dispatcher``'s low-latency form (``has_low_latency_form``): the same ranks, group and
    link, blocks of ``capacity`` rows per expert; under attention TP each rank's share."""
    if isinstance(dispatcher, ScatteredDispatcher):
        return ScatteredDispatcher(low_latency_form(dispatcher.inner, capacity), dispatcher.attn_tp)
    assert isinstance(dispatcher, AllToAllDispatcher), "refused by step_a2a_mode"
    return LowLatencyDispatcher(dispatcher, capacity)


def dispatch_share(dispatcher: Dispatcher) -> int:
    """The ranks among which each dispatch's tokens are cut: attention TP's size under
    ``ScatteredDispatcher`` (each sends about 1/share of them), else 1."""
    return dispatcher.attn_tp.size if isinstance(dispatcher, ScatteredDispatcher) else 1
