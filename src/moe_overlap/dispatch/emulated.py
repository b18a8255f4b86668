"""The all-to-all dispatcher of rank 0 of an EP group whose peers are emulated
(``bench --emulate-peers N``, ``distributed/emulated.py``).

Everything but the counts exchange is ``AllToAllDispatcher``'s own code: the rows go through
the emulated group's all-to-all (a device copy), the modelled link's time is set from the rows
that would cross to the N-1 peers, and SBO's pieces are cut as on a real rank. By symmetry of
uniform load, what rank 0 receives from peer p is as many rows as it sends p, for the same
local experts: its experts compute what a real rank of ep=N computes (the values themselves are
not a real forward's, so logits under emulation mean nothing; the timing is the point).
"""

from __future__ import annotations

import torch

from moe_overlap.core.timeline import Timeline
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.fp8_rows import PlainRows
from moe_overlap.distributed.emulated import EmulatedGroup
from moe_overlap.distributed.modelled_link import ModelledLink


class EmulatedAllToAllDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` over an ``EmulatedGroup``: no counts cross either."""

    def __init__(
        self,
        group: EmulatedGroup,
        num_experts: int,
        link: ModelledLink | None = None,
        timeline: Timeline | None = None,
        wire: PlainRows | None = None,
    ):
        super().__init__(group, num_experts, link, timeline, wire)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return symmetric_counts(counts)


def symmetric_counts(counts: torch.Tensor) -> torch.Tensor:
    """Every rank's counts (``[ep, ep, local]``: rank p's rows to rank q's local experts) when
    each rank routes as rank 0 does (``counts``: ``[ep, local]``).

    Rank 0's own row is ``counts``; every other rank p sends itself what rank 0 sends itself
    and sends each other rank (rank 0 included) what rank 0 sends p. So each peer sends rank 0
    as many rows as it gets from it, for the same local experts, every rank receives from the
    others what rank 0 does, and SBO's blocks, balanced by those rows, are alike on every rank.
    """
    ep = counts.shape[0]
    p = torch.arange(ep).view(-1, 1).expand(ep, ep)
    q = torch.arange(ep).view(1, -1).expand(ep, ep)
    source = torch.where(p == 0, q, torch.where(p == q, 0, p))
    return counts[source]
