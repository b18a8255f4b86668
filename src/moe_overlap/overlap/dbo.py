"""Dual batch overlap (vLLM DBO): two micro-batches on two threads that pass a baton.

Each micro-batch runs the whole model on its own thread, and exactly one thread runs model code
at a time. At each yield of the strategy table's DBO entry (vLLM's order: right after the
dispatch send, and after the combine send plus the shared experts), a micro-batch hands the
baton to the other micro-batch and sleeps, so one micro-batch computes while the other's
all-to-all is in flight. Waiting for an all-to-all is a receive hook that the *other*
micro-batch runs at its next yield point, after its own compute (vLLM's
``dbo_register_recv_hook`` / ``dbo_maybe_run_recv_hook``); the owner's ``dispatch_b`` /
``combine_b`` then finds its handle complete (a handle's second ``wait`` returns at once).

Exactness: both micro-batches run the same op list, so they reach the same yields in the same
order; the baton starts at micro-batch 0 and strictly alternates, so micro-batch 1 starts its
k-th segment only after micro-batch 0 finished its k-th segment (or all of its ops). Every op of
micro-batch 1, layer i's attention included, thus runs after the same op of micro-batch 0, and
the second piece of a cut sequence attends over KV the first piece already wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch, most_tokens
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import DBO
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.streams import MicroBatchStreams
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.loader import model_placement
from moe_overlap.overlap.agreement import dbo_agree, dbo_decide_from
from moe_overlap.overlap.baton import GRACE_S, DualBatchThreads, Hook
from moe_overlap.overlap.scheme import Runner
from moe_overlap.overlap.split import merge_outputs, split_batch, split_inputs, token_split
from moe_overlap.overlap.strategy import build_operations, strategy_for


def receive_hook(ctx: ForwardContext) -> Hook:
    """The wait for the all-to-all this micro-batch just launched. The other micro-batch runs
    it, so the timeline records it on the runner's ``"mbN wait"`` track."""
    return ctx.state.get("dispatch").pending.wait


def _baton_timeout(group: Group) -> float:
    return group.timeout.total_seconds() + GRACE_S if group.pg is not None else 60.0


class DualBatchOverlap:
    """The DBO scheme: agree across ranks, cut the batch in two by tokens, run both halves
    on the scheme's threads, merge the logits."""

    def __init__(
        self,
        model: MoeForCausalLM,
        cfg: OverlapConfig,
        group: Group,
        timeout_s: float | None = None,
    ):
        self.model, self.cfg, self.group = model, cfg, group
        self.ops = build_operations(model, strategy_for(model, DBO.name))
        streams = MicroBatchStreams(model_placement(model)[0])  # CUDA: one per micro-batch
        # a stall leaves a thread inside a collective: abort the group so no peer waits on it
        # and no later collective of this rank pairs with it
        self.threads = DualBatchThreads(
            timeout_s or _baton_timeout(group), streams=streams, on_stall=group.abort
        )
        self.num_overlapped = 0  # forwards that ran as two micro-batches

    def forward(
        self, batch: ForwardBatch, runner: Runner, inputs: StageInputs | None = None
    ) -> ForwardOutputs | None:
        """The outputs (logits, or a pipeline stage's hidden states) of an overlapped forward,
        or None if the ranks agreed not to micro-batch."""
        decision = dbo_agree(batch, self.cfg, self.group)
        if not decision.run:
            runner.timeline.mark_decision(decision.reason)
            return None
        return self.run(batch, runner, decision.split_point, inputs)

    def largest_dispatch(self, batches: Sequence[ForwardBatch]) -> int:
        decision = dbo_decide_from(batches, self.cfg)
        if not decision.run:
            return most_tokens(batches)
        cut = decision.split_point
        return max(max(cut, b.num_tokens - cut) for b in batches)

    def run(
        self,
        batch: ForwardBatch,
        runner: Runner,
        split_point: int,
        inputs: StageInputs | None = None,
    ) -> ForwardOutputs:
        """Run ``batch`` as two micro-batches cut at token ``split_point`` (agreed by every
        rank, with tokens on both sides)."""
        plan = token_split(batch.extend_lens, [split_point])
        children = split_batch(batch, plan)
        runner.timeline.mark_split([child.num_tokens for child in children])
        ctxs = [runner.context(c, tracks.micro_batch(i)) for i, c in enumerate(children)]
        outputs = self.threads.run(ctxs, self.ops, receive_hook, split_inputs(batch, plan, inputs))
        self.num_overlapped += 1
        return merge_outputs(batch, plan, outputs)

    def close(self) -> None:
        self.threads.close()
