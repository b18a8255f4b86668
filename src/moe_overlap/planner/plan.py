"""Predict each overlap mode's forward: the engine's decisions, splits and schedules, timed.

For every mode the planner takes the engine's own steps on every rank's batch: the TBO vote
(``agreement.tbo_local_vote`` / ``tbo_decide``) and split (``TwoBatchOverlap.plan``, built on
the simulated model), the DBO vote and cut (``dbo_local_column`` / ``dbo_decide``,
``split.token_split``), the strategy table's op lists (``strategy_for`` / ``build_operations``)
and the stage executor (``execute_overlapped``), then reads the simulated clocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.mode_labels import auto_choice_configs
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE, Runs
from moe_overlap.core.timeline import Span
from moe_overlap.distributed.groups import Group
from moe_overlap.overlap.agreement import dbo_decide, dbo_local_column, tbo_decide, tbo_local_vote
from moe_overlap.overlap.operations import Op, Yield, execute_overlapped
from moe_overlap.overlap.predict import MARGIN
from moe_overlap.overlap.split import split_batch, token_split
from moe_overlap.overlap.strategy import build_operations, strategy_for
from moe_overlap.overlap.tbo import TwoBatchOverlap
from moe_overlap.planner.cluster import Cluster, overheads_us
from moe_overlap.planner.costs import CostModel
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.simulate import (
    RankClocks,
    SimContext,
    SimModel,
    sbo_sim_ops,
    with_switches,
)


@dataclass
class ModePlan:
    mode: str
    seconds: float  # predicted time of one forward (the slowest rank)
    # the busiest rank's compute, and the per-forward overhead no mode hides (as the bench's
    # T_comp = T_none - T_comm holds it), so that none takes T_comp + T_comm
    t_comp: float
    t_comm: float  # the busiest rank's all-to-all time, launch to completion
    micro_batches: list[list[int]]  # per micro-batch: tokens on each rank
    note: str = ""  # e.g. why the ranks agreed not to overlap
    spans: list[list[Span]] | None = None  # per rank, seconds from the forward's start
    # the same schedule with no host cost: what the stage order alone allows (its first
    # dispatch and last combine stay exposed); ``seconds`` where the cluster has no host cost
    zero_host_s: float = 0.0

    @property
    def limit(self) -> float:
        return max(self.t_comp, self.t_comm)

    @property
    def bottleneck(self) -> str:
        return "compute" if self.t_comp >= self.t_comm else "communication"


class Planner:
    """Plans one step: ``batches[r]`` is rank r's batch (all ranks of a layout)."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, layout: PlanLayout):
        self.spec, self.cluster, self.layout = spec, cluster, layout
        self.costs = CostModel(spec, cluster, layout)
        self.first_costs = self.costs  # the first micro-batch's (and none's)
        if cluster.overheads_beyond_first:
            free = overheads_us(0.0, 0.0, 0.0)
            self.first_costs = CostModel(spec, dataclasses.replace(cluster, **free), layout)
        self.model = SimModel(spec.cfg)
        self._ops: dict[str, list[Op | Yield]] = {}
        free_host = dataclasses.replace(cluster, host_launch_us=0.0, decode_host_launch_us=0.0)
        hosted = cluster.host_launch_s(False) or cluster.host_launch_s(True)
        self.zero_host = Planner(spec, free_host, layout) if hosted else None  # the bound's

    def ops(self, scheme: str = NONE.name, blocks: int = 2) -> list[Op | Yield]:
        """The op list the mode ``scheme`` runs, as the simulator runs it."""
        key = f"{scheme}{blocks}"
        if key not in self._ops:
            runs = MODES[scheme].runs
            own = sbo_sim_ops(blocks) if runs is Runs.BLOCKS else None
            ops = build_operations(self.model, strategy_for(self.model, scheme), own)
            self._ops[key] = with_switches(ops) if runs is Runs.THREADS else ops
        return self._ops[key]

    def plan(
        self, mode: str, cfg: OverlapConfig, batches: list[ForwardBatch], record: bool = False
    ) -> ModePlan:
        """``mode`` (run as ``cfg``) on every rank's batch, with its zero-host-cost bound."""
        out = self._plan(mode, cfg, batches, record)
        bound = self.zero_host._plan(mode, cfg, batches, False) if self.zero_host else out
        return dataclasses.replace(out, zero_host_s=bound.seconds)

    def _plan(
        self, mode: str, cfg: OverlapConfig, batches: list[ForwardBatch], record: bool
    ) -> ModePlan:
        runs = MODES[cfg.mode].runs
        if runs is Runs.CHOICE:
            return self._auto(mode, cfg, batches, record)
        if runs is Runs.SPLIT:
            return self._tbo(mode, cfg, batches, record)
        if runs is Runs.THREADS:
            return self._dbo(mode, cfg, batches, record)
        if runs is Runs.BLOCKS:  # the engine makes no more blocks than a rank has experts
            local = self.layout.slots_per_gpu(self.spec.cfg)
            ops = self.ops(cfg.mode, min(cfg.sbo_combine_blocks, local))
            return self._run(mode, [batches], ops, 0, record)
        return self._run(mode, [batches], self.ops(cfg.mode), 0, record)

    def _tbo(
        self, mode: str, cfg: OverlapConfig, batches: list[ForwardBatch], record: bool
    ) -> ModePlan:
        columns = [tbo_local_vote(b, cfg.tbo_min_tokens) for b in batches]
        votes = [min(v) for v in zip(*columns, strict=True)]  # the all-reduce(MIN)
        decision = tbo_decide(votes, cfg.tbo_mode_mismatch)
        if not decision.run:
            out = self._run(mode, [batches], self.ops(), 0, record, agree=True)
            return dataclasses.replace(out, note=f"no overlap: {decision.reason}")
        # a split mode cuts and orders its micro-batches as TBO does; its plan needs no peers
        tbo = TwoBatchOverlap(self.model, cfg, Group.single(name="ep"))
        per_rank = [split_batch(b, tbo.plan(b)) for b in batches]
        micro = [list(mb) for mb in zip(*per_rank, strict=True)]
        strategy = tbo.strategies[decision.decode]
        out = self._run(mode, micro, tbo.ops[decision.decode], strategy.delta_stages, record, True)
        return dataclasses.replace(out, note=empty_note(out.micro_batches))

    def _dbo(
        self, mode: str, cfg: OverlapConfig, batches: list[ForwardBatch], record: bool
    ) -> ModePlan:
        table = torch.tensor([dbo_local_column(b, cfg) for b in batches], dtype=torch.int64).T
        decision = dbo_decide(table)
        if not decision.run:
            out = self._run(mode, [batches], self.ops(), 0, record, agree=True)
            return dataclasses.replace(out, note=f"no overlap: {decision.reason}")
        per_rank = [
            split_batch(b, token_split(b.extend_lens, [decision.split_point])) for b in batches
        ]
        micro = [list(mb) for mb in zip(*per_rank, strict=True)]
        # DBO's baton threads alternate at the same yields: the stage order with no lag
        return self._run(mode, micro, self.ops(cfg.mode), 0, record, agree=True)

    def _auto(
        self, mode: str, cfg: OverlapConfig, batches: list[ForwardBatch], record: bool
    ) -> ModePlan:
        plans = {
            name: self._plan(name, candidate, batches, record)
            for name, candidate in auto_choice_configs().items()
            if name in cfg.auto_modes
        }
        best = min(plans, key=lambda m: plans[m].seconds)
        none = plans.get(NONE.name)
        if none is not None and plans[best].seconds > none.seconds * (1 - MARGIN):
            best = NONE.name
        return dataclasses.replace(plans[best], mode=mode, note=f"auto picks {best}")

    def _run(
        self,
        mode: str,
        micro: list[list[ForwardBatch]],
        ops: list[Op | Yield],
        delta: int,
        record: bool,
        agree: bool = False,
    ) -> ModePlan:
        clocks = RankClocks(self.layout.world, self.costs, record)
        if agree and self.layout.world > 1:  # the one small all-reduce overlap pays
            clocks.host_meet(self.cluster.a2a_latency_us * 1e-6)
        ctxs = [
            SimContext(
                tracks.micro_batch(i),
                clocks,
                (self.costs if i else self.first_costs).micro_batch(children),
            )
            for i, children in enumerate(micro)
        ]
        execute_overlapped(ctxs, [ops] * len(ctxs), delta)
        overhead = self.cluster.forward_overhead_us * 1e-6  # the host's, on the critical path
        end = max(clocks.now + clocks.host) + overhead
        tokens = [[b.num_tokens for b in children] for children in micro]
        return ModePlan(
            mode,
            end,
            max(clocks.compute_s) + overhead,
            max(clocks.comm_s),
            tokens,
            spans=clocks.spans if record else None,
        )


def empty_note(micro_batches: list[list[int]]) -> str:
    """Which micro-batches some busy rank runs with no rows (plain TBO on one sequence)."""
    busy = [sum(rank) > 0 for rank in zip(*micro_batches, strict=True)]
    empty = [
        i
        for i, mb in enumerate(micro_batches)
        if any(b and not n for b, n in zip(busy, mb, strict=True))
    ]
    return f"micro-batch {', '.join(map(str, empty))} empty" if empty else ""
