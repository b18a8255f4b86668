"""Single-batch overlap (SGLang SBO): hide the MoE all-to-all inside one batch's own MoE layer.

Two overlaps, no micro-batches:
- dispatch's receive overlaps the shared experts: they run between ``dispatch_a`` (which starts
  the all-to-all) and ``dispatch_b`` (which waits for it);
- combine overlaps the down projection: this rank's local experts run in blocks cut where the
  rows that cross ranks balance (``core/dispatcher.py: balanced_blocks``, at whole experts), and
  as soon as a block is done its outputs start back to their source ranks while the next block
  computes.

Every rank runs its own batch, so nothing is agreed per forward; the number of combine pieces
depends only on the settings and the local expert count, which are the same on every rank, and
every rank knows each owner's blocks from the counts dispatch gathered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch, most_tokens
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import SBO
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs, op_inputs
from moe_overlap.distributed.groups import Group
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.decoder import DecoderLayer
from moe_overlap.model.moe import ExpertBank
from moe_overlap.overlap.operations import Op, execute_operations
from moe_overlap.overlap.scheme import Runner
from moe_overlap.overlap.strategy import SchemeOp, build_operations, strategy_for


class CommLane:
    """Where SBO launches a combine piece: right after the block of experts that produced it.

    CPU (gloo): ops run in program order on the caller's thread and an async all-to-all
    progresses on gloo's own thread, so launching is a plain call and the next block computes
    while the piece is in flight.

    CUDA: the dispatcher
    launches each piece on its communication stream after an event on the compute stream
    (``distributed/streams.py: CommStream``), so piece b follows block b's down projection on
    the GPU while block b + 1 computes, and the consumer's stream waits on the piece's event.
    What is *not* done is reserving ``comm_sms`` SMs for communication (SGLang: 3 on Hopper, 32
    on Blackwell) and giving the down GEMM the rest: that needs a communication kernel and a
    GEMM that take an SM budget (DeepEP, DeepGEMM). ``comm_sms`` is validated and recorded
    only; it changes nothing on CPU.
    """

    def __init__(self, comm_sms: int, device: torch.device):
        self.comm_sms, self.device = comm_sms, device
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).multi_processor_count
            if comm_sms >= total:
                raise ConfigError(
                    f"--sbo-comm-sms={comm_sms} leaves no SMs for computation ({total} in all)"
                )


def experts_then_combine(
    num_blocks: int, run_block: Callable[[int], None], send_piece: Callable[[int], None]
) -> None:
    """SBO's combine overlap, the one loop the engine (``ExpertsThenCombine``) and the planner's
    simulator both run: block i of the local experts computes, then its piece of the combine
    starts back at once and stays in flight while block i + 1 computes."""
    for i in range(num_blocks):
        run_block(i)
        send_piece(i)


@dataclass
class ExpertsThenCombine:
    """One MoE layer's ``experts`` and ``combine_a``, interleaved block by block."""

    layer_id: int
    bank: ExpertBank
    num_blocks: int
    lane: CommLane

    def __call__(self, ctx: ForwardContext) -> None:
        d = ctx.state.get("dispatch")
        d.expert_outputs = d.empty_outputs()
        blocks = ctx.dispatcher.combine_blocks(d, self.num_blocks)  # by crossing rows

        def run_block(i: int) -> None:
            with _span(ctx, f"layer {self.layer_id} experts {i}/{len(blocks)}"):
                self.bank.run_block(d, d.expert_outputs, blocks[i])

        experts_then_combine(len(blocks), run_block, lambda i: ctx.dispatcher.combine_a_block(d, i))


def _span(ctx: ForwardContext, name: str):
    # a track of its own: the stage spans on ctx.name already cover this time
    timeline = ctx.timeline
    return (
        timeline.span(tracks.sbo_block(ctx.name), name) if timeline is not None else nullcontext()
    )


def _timed(layer_id: int, name: str, op: Op) -> Op:
    @functools.wraps(op)  # keeps the op's name
    def run(ctx: ForwardContext, **kw) -> dict | None:
        with _span(ctx, f"layer {layer_id} {name}"):
            return op(ctx, **kw)

    return run


def sbo_ops(blocks: int, lane: CommLane) -> dict[str, SchemeOp[DecoderLayer]]:
    """SBO's own ops: expert blocks each launching its combine piece, and the shared experts
    timed on the SBO track."""

    def experts_combine_a(layer: DecoderLayer) -> Op:
        bank = layer.mlp.experts
        assert isinstance(bank, ExpertBank), f"layer {layer.layer_id} has no routed experts"
        return ExpertsThenCombine(layer.layer_id, bank, blocks, lane)

    def shared_experts(layer: DecoderLayer) -> Op:
        return _timed(layer.layer_id, "shared experts", layer.op("shared_experts"))

    return {
        "experts_combine_a": SchemeOp(("experts", "combine_a"), experts_combine_a),
        "shared_experts": SchemeOp(("shared_experts",), shared_experts),
    }


class SingleBatchOverlap:
    """The SBO scheme: ``forward(batch, runner)`` returns the batch's outputs (its logits)."""

    def __init__(self, model: MoeForCausalLM, cfg: OverlapConfig, group: Group):
        self.model, self.cfg, self.group = model, cfg, group
        self.lane = CommLane(cfg.sbo_comm_sms, group.device)
        own = sbo_ops(cfg.sbo_combine_blocks, self.lane)
        self.ops = build_operations(model, strategy_for(model, SBO.name), own)

    def forward(
        self, batch: ForwardBatch, runner: Runner, inputs: StageInputs | None = None
    ) -> ForwardOutputs:
        """The outputs (logits ``[rows, vocab]``, or a pipeline stage's hidden states); an idle
        rank runs the same all-to-alls with no rows."""
        return ForwardOutputs.of(
            execute_operations(runner.context(batch), self.ops, op_inputs(inputs))
        )

    def largest_dispatch(self, batches: Sequence[ForwardBatch]) -> int:
        return most_tokens(batches)  # one batch; its combine goes in pieces, its dispatch whole
