"""Pipeline parallelism: one rank's stage of a forward, with several micro-batches in flight.

Each step's batch is cut into ``pp`` micro-batches of nearly equal tokens (a prompt may be cut:
its later piece runs after the earlier one on every stage, so it sees the earlier piece's KV).
A stage takes each micro-batch's hidden states and residual from the previous stage (the first
embeds), runs its layers under the step's overlap scheme, and sends the result on without
waiting for it to arrive, so it starts the next micro-batch while the next stage works on this
one (SGLang keeps ``pp_size`` micro-batches in flight the same way). The last stage returns the
logits, reassembled in batch order; the others return none. Every stage runs every
micro-batch, idle ones included, so the collectives inside a stage stay matched.
"""

from __future__ import annotations

import torch

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.stage_io import StageInputs
from moe_overlap.distributed.groups import Group
from moe_overlap.overlap.split import merge_logits, merge_outputs, plan_even_tokens, split_batch


class PipelineStage:
    def __init__(self, runner, pp: Group):
        self.runner, self.pp = runner, pp
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1

    def forward(self, batch: ForwardBatch, overlap: OverlapConfig | None) -> torch.Tensor:
        plan = plan_even_tokens(batch, self.pp.size)
        sends, outs = [], []
        timeline = self.runner.timeline
        for i, child in enumerate(split_batch(batch, plan)):
            with timeline.span(tracks.pipeline(i), f"stage {self.pp.rank}, micro-batch {i}"):
                received = None if self.first else self.pp.recv_dict(self.pp.rank - 1)
                inputs = None if received is None else StageInputs.from_dict(received)
                out = self.runner.forward_stage(child, overlap, inputs)
            if self.last:
                outs.append({"logits": out.final_logits(), "hidden": out.hidden})
            else:
                handoff = out.handoff().as_dict()
                sends.append(self.pp.send_dict(handoff, self.pp.rank + 1, wait=False))
        for send in sends:  # the next stage has taken every micro-batch
            send.wait()
        if not self.last:
            return torch.zeros(0)
        if outs and outs[0]["hidden"] is not None:  # the MTP drafter's input, the whole batch's
            merged = merge_outputs(batch, plan, outs)
            self.runner.last_hidden = merged.hidden
            return merged.final_logits()
        return merge_logits(batch, plan, [out["logits"] for out in outs])
