"""The planner's zero-host-cost bound beside a bench's measurements: what each mode's stage
order would allow from the measured ``T_comp`` and ``T_comm`` (``planner/stage_bound.py``)."""

from __future__ import annotations

from moe_overlap.core.a2a_mode import DispatchDtype
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.workloads import make_batches
from moe_overlap.planner.inputs import ModelSpec, make_layout
from moe_overlap.planner.stage_bound import stage_order_bound
from moe_overlap.tools.bench import BenchReport


def zero_host_bounds(
    report: BenchReport,
    cfg: ModelConfig,
    par: ParallelConfig,
    peers: int,
    overrides: dict[str, OverlapConfig],
    seed: int,
    dispatch_dtype: str = DispatchDtype.AUTO,
) -> dict[str, float | None]:
    """Per mode, the planner's zero-host-cost bound from the measured ``T_comp`` and
    ``T_comm`` (plus the attention-TP collectives, which no mode hides); None for every mode
    where the planner does not model the layout (pipeline stages, MoE-TP)."""
    try:
        if peers:
            layout = make_layout(None, None, peers, False, cfg)
        else:
            tp, dp = (None if par.tp == 1 else par.tp), (None if par.dp == 1 else par.dp)
            layout = make_layout(tp, dp, par.ep, par.enable_dp_attention, cfg)
        if par.pp > 1:
            raise ConfigError("the planner models no pipeline stages")
    except ConfigError:
        return {mode: None for mode in report.results}
    groups = make_batches(report.workload, cfg.vocab_size, seed)
    batches = [groups[0 if peers else layout.group_of(r)] for r in range(layout.world)]
    fp8 = dispatch_dtype == DispatchDtype.FP8  # the dispatch's share of the bytes is smaller
    spec = ModelSpec(cfg, "bench", fp8_weights=False, fp8_dispatch=fp8)
    return {
        mode: report.t_tp_comm
        + stage_order_bound(
            spec,
            layout,
            batches,
            overrides.get(mode) or mode_config(mode),
            report.t_comp,
            report.t_comm,
        )
        for mode in report.results
    }
