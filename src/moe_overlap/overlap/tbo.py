"""Two-batch overlap (SGLang TBO, with token-level two-chunk splitting and N micro-batches).

Whether to micro-batch, and with which strategy, is agreed across ranks (agreement.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch, ForwardMode, most_tokens
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import TBO
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs
from moe_overlap.distributed.groups import Group
from moe_overlap.overlap.agreement import tbo_agree, tbo_decide_from
from moe_overlap.overlap.operations import execute_overlapped
from moe_overlap.overlap.scheme import Runner
from moe_overlap.overlap.split import (
    merge_outputs,
    plan_even_tokens,
    plan_two_batch,
    split_batch,
    split_inputs,
)
from moe_overlap.overlap.strategy import StagedModel, Strategy, build_operations, strategy_for


class TwoBatchOverlap:
    def __init__(
        self,
        model: StagedModel,
        cfg: OverlapConfig,
        group: Group,
        strategies: dict[tuple[str, str, str], Strategy] | None = None,
    ):
        self.model, self.cfg, self.group = model, cfg, group
        self.cost = ModelFlops.for_model(model.cfg) if cfg.tbo_split_policy == "time" else None
        # lockstep decode: prefill's stages (core/overlap_config.py: DECODE_ORDERS)
        staggered = cfg.tbo_decode_order == "staggered"
        self.strategies = {
            d: strategy_for(model, TBO.name, d and staggered, strategies) for d in (False, True)
        }
        self.ops = {d: build_operations(model, self.strategies[d]) for d in (False, True)}

    def plan(self, batch: ForwardBatch):
        n = self.cfg.num_micro_batches
        if batch.mode == ForwardMode.IDLE:
            return [[] for _ in range(n)]
        if n == 2:
            return plan_two_batch(batch, self.cfg.tbo_token_distribution_threshold, self.cost)
        return plan_even_tokens(batch, n, self.cost)

    def largest_dispatch(self, batches: Sequence[ForwardBatch]) -> int:
        if not tbo_decide_from(batches, self.cfg).run:
            return most_tokens(batches)
        return max(sum(p.length for p in child) for b in batches for child in self.plan(b))

    def forward(
        self, batch: ForwardBatch, runner: Runner, inputs: StageInputs | None = None
    ) -> ForwardOutputs | None:
        """The outputs (logits, or a pipeline stage's hidden states) of an overlapped forward,
        or None if the ranks agreed not to micro-batch."""
        decision = tbo_agree(batch, self.cfg, self.group)
        if not decision.run:
            runner.timeline.mark_decision(decision.reason)
            return None
        return self.run(batch, runner, decision.decode, inputs)

    def run(
        self, batch: ForwardBatch, runner: Runner, decode: bool, inputs: StageInputs | None = None
    ) -> ForwardOutputs:
        """Micro-batch ``batch`` (every rank has agreed to) with the decode or prefill strategy."""
        plan = self.plan(batch)
        children = split_batch(batch, plan)
        runner.timeline.mark_split([child.num_tokens for child in children])
        ctxs = [runner.context(child, tracks.micro_batch(i)) for i, child in enumerate(children)]
        strategy = self.strategies[decode]
        ops = [self.ops[decode]] * len(ctxs)
        outs = execute_overlapped(
            ctxs, ops, strategy.delta_stages, split_inputs(batch, plan, inputs)
        )
        return merge_outputs(batch, plan, outs)
