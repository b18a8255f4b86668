"""The expert-distribution recorder on a rank: while on, each MoE layer counts the rows this
rank sends each physical slot, on the device; the counts cross to the host only when the
driver reads them (``Executor.expert_load``), never per step."""

from __future__ import annotations

import torch
from torch import nn

from moe_overlap.model.moe_block import SparseMoeBlock

ACTIONS = ("start", "stop", "read")


def expert_load(model: nn.Module, action: str) -> dict[int, list[int]] | None:
    """``start``: zero the counts and record; ``stop``: stop recording (the counts stay);
    ``read``: each MoE layer's counts per physical slot, by layer id."""
    blocks = {m.layer_id: m for m in model.modules() if isinstance(m, SparseMoeBlock)}
    if action not in ACTIONS:
        raise ValueError(f"expert recorder action {action!r}: want one of {', '.join(ACTIONS)}")
    if action == "read":
        return {i: block.routed.tolist() for i, block in sorted(blocks.items())}
    for block in blocks.values():
        if action == "start":
            with torch.no_grad():
                block.routed.zero_()
        block.record = action == "start"
    return None
