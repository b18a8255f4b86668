"""The zero-host-cost bound of a mode from a measured ``T_comp`` and ``T_comm``.

What the bench can compare a mode's measured time with: the planner's simulator runs the
mode's own stage order on a cluster made to match the measurement, with no host cost. Compute
is spread over the ops by their FLOPs at one rate, the all-to-alls by their bytes at one link
rate, and both rates are set so that the simulated no-overlap forward computes ``t_comp`` and
communicates ``t_comm``. Splitting then costs nothing (no fixed cost per op or per pass), so
the bound is what the schedule alone allows: at least ``max(t_comp, t_comm)``, with the first
dispatch and the last combine (and any rank or micro-batch imbalance) exposed.
"""

from __future__ import annotations

import dataclasses
import math

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.planner.cluster import Cluster
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.plan import Planner

_NONE = OverlapConfig(NONE.name)


def unit_cluster(world: int) -> Cluster:
    """One FLOP rate and one link rate everywhere; memory, latency and host cost free."""
    return Cluster(
        name="measured",
        nodes=1,
        gpus_per_node=world,
        gemm_tflops_bf16=1.0,
        gemm_efficiency=1.0,
        attention_efficiency=1.0,
        hbm_gbps=math.inf,
        intra_node_a2a_gbps=1.0,
        inter_node_a2a_gbps=1.0,
        allreduce_gbps=math.inf,  # the bench measures attention TP's collectives apart
        a2a_latency_us=0.0,
    )


def stage_order_bound(
    spec: ModelSpec,
    layout: PlanLayout,
    batches: list[ForwardBatch],
    cfg: OverlapConfig,
    t_comp: float,
    t_comm: float,
) -> float:
    """The simulated time of mode ``cfg`` on every rank's batch (``batches[r]``) with compute
    and communication scaled to the measured no-overlap ``t_comp`` and ``t_comm`` seconds."""
    if t_comp <= 0 or t_comm <= 0:
        return t_comp + t_comm  # nothing to overlap
    unit = unit_cluster(layout.world)
    none = Planner(spec, unit, layout).plan(NONE.name, _NONE, batches)
    if none.t_comp <= 0 or none.t_comm <= 0:
        return t_comp + t_comm  # nothing the schedule could overlap (one rank, no experts)
    link = none.t_comm / t_comm
    fitted = dataclasses.replace(
        unit,
        gemm_tflops_bf16=none.t_comp / t_comp,
        intra_node_a2a_gbps=link,
        inter_node_a2a_gbps=link,
    )
    return Planner(spec, fitted, layout).plan("mode", cfg, batches).seconds
