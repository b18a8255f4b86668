"""Two-batch overlap (SGLang TBO, with token-level two-chunk splitting and N micro-batches).

Every EP rank must issue the same all-to-alls in the same order, so whether to micro-batch, and
which strategy to use, is agreed by one small all-reduce per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_overlap.config import OverlapConfig
from moe_overlap.engine.forward_batch import ForwardBatch, ForwardMode
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.overlap.operations import execute_overlapped
from moe_overlap.overlap.split import (
    CostModel,
    merge_logits,
    plan_even_tokens,
    plan_two_batch,
    split_batch,
)
from moe_overlap.overlap.strategy import build_operations, strategy_for


@dataclass(frozen=True)
class TboDecision:
    run: bool  # micro-batch on every rank, or on none
    decode: bool  # every busy rank is decoding: use the decode strategy


def local_vote(batch: ForwardBatch, min_tokens: int = 2) -> tuple[bool, bool]:
    """(can this rank micro-batch?, is it decoding?) An idle rank says yes to both; a batch
    below ``min_tokens``, or a decode batch of one sequence, says no."""
    if batch.mode == ForwardMode.IDLE:
        return True, True
    big_enough = batch.num_tokens >= min_tokens
    if batch.mode == ForwardMode.DECODE:
        return big_enough and batch.num_seqs >= 2, True
    return big_enough and batch.num_tokens >= 2, False


def agree(batch: ForwardBatch, group, min_tokens: int = 2) -> TboDecision:
    """One all-reduce (MIN over both votes) so every rank takes the same path."""
    can, decode = local_vote(batch, min_tokens)
    votes = torch.tensor([int(can), int(decode)], dtype=torch.int64)
    if group is not None and group.size > 1:
        votes = group.all_reduce(votes, op=dist.ReduceOp.MIN)
    return TboDecision(bool(votes[0]), bool(votes[1]))


class TwoBatchOverlap:
    def __init__(
        self, model: MoeForCausalLM, cfg: OverlapConfig, group=None, strategies: dict | None = None
    ):
        self.model, self.cfg, self.group = model, cfg, group
        self.cost = CostModel.for_model(model.cfg) if cfg.tbo_split_policy == "time" else None
        self.strategies = {d: strategy_for(model, d, strategies) for d in (False, True)}
        self.ops = {d: build_operations(model, self.strategies[d]) for d in (False, True)}

    def plan(self, batch: ForwardBatch):
        n = self.cfg.num_micro_batches
        if batch.mode == ForwardMode.IDLE:
            return [[] for _ in range(n)]
        if n == 2:
            return plan_two_batch(batch, self.cfg.tbo_token_distribution_threshold, self.cost)
        return plan_even_tokens(batch, n, self.cost)

    def forward(self, batch: ForwardBatch, runner) -> torch.Tensor | None:
        """Logits of an overlapped forward, or None if the ranks agreed not to micro-batch."""
        decision = agree(batch, self.group, self.cfg.tbo_min_tokens)
        if not decision.run:
            return None
        plan = self.plan(batch)
        ctxs = [runner.context(child, f"mb{i}") for i, child in enumerate(split_batch(batch, plan))]
        strategy = self.strategies[decision.decode]
        outs = execute_overlapped(
            ctxs, [self.ops[decision.decode]] * len(ctxs), strategy.delta_stages
        )
        return merge_logits(batch, plan, [o["logits"] for o in outs])
