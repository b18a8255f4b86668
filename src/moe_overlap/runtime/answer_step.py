"""A data-parallel group's answer for one batch on a rank, and after it the MTP drafts
(``--speculative-algorithm EAGLE``), which every rank holding the MTP layers computes: the
step's batch, and under PD multiplexing a prefill wave's batch after its last range."""

from __future__ import annotations

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import GroupReply, SampleSpec
from moe_overlap.runtime.model_runner import ModelRunner
from moe_overlap.runtime.sampler import answer


def answer_and_draft(
    runner: ModelRunner,
    batch: ForwardBatch,
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    samples: list[SampleSpec] | None,
    mode: str,
    answers: bool,
) -> GroupReply | None:
    """The group's reply where this rank ``answers`` (else None), its sampled sequences' MTP
    drafts verified against their q; then, with MTP layers, the drafts after it (``hidden``:
    the batch's final hidden states), which every such rank computes (the MTP layer's
    collectives) and the answering one returns in ``GroupReply.drafts``."""
    mtp, reply = runner.mtp, None
    if answers:
        probs = mtp.probs.of(batch, samples) if mtp is not None and samples else ()
        reply = answer(batch, logits, samples, mode, probs)
    if mtp is not None and samples is not None:
        drafts = mtp.draft(batch, hidden, samples, reply, runner.dispatcher, runner.timeline)
        if reply is not None:
            reply.drafts = drafts
    return reply
