"""The executor contract: run one step's per-rank batches on however many ranks there are.

``LocalExecutor`` (one process), ``SpawnedExecutor`` (rank processes started here) and
``TorchrunExecutor`` (a torchrun launch, one or several machines) implement it; ``LLM`` and the
bench talk to every one of them the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.timeline import Span


class Executor(ABC):
    num_ranks: int  # processes
    # batches per step, one per attention-DP group; rank r runs batch r // (num_ranks / num_dp)
    num_dp: int
    is_driver: bool = True  # False on torchrun ranks > 0, which only serve rank 0's steps
    last_spans: list[list[Span] | None]  # per rank, the spans of the last recorded step
    # per data-parallel group, the logits of the prefill wave whose last range just ran
    last_prefill: list[torch.Tensor] | None = None

    @abstractmethod
    def run(
        self,
        batches: list[ForwardBatch],
        overlap: OverlapConfig | None = None,
        record: bool = False,
        prefill=None,
    ) -> list[torch.Tensor]:
        """Each attention-DP group's logits for its batch (``batches[d]`` runs on group d's
        ranks). ``overlap``
        overrides the engine's scheme for this step; with ``record`` each rank's timeline
        spans land in ``last_spans``. ``prefill`` (a ``PrefillSlice``, ``--enable-pdmux``)
        runs beside the batches; after its last range its logits land in ``last_prefill``."""

    def probe(self, num_bytes: int, repeats: int = 5, p2p: bool | None = None) -> list[list[float]]:
        """Per rank, the seconds of each all-to-all of ``num_bytes`` over the engine's link."""
        raise ConfigError("probing the link needs 2 or more ranks (--ep or --tp)")

    def serve(self) -> None:
        """Ranks that do not drive: serve the driver's steps until it ends the call."""
        return None  # every rank drives here

    def end_generate(self) -> None:
        """The driver finished a ``generate`` call (releases serving ranks)."""
        return None  # nobody waits here

    def health(self) -> str | None:
        """Why some rank cannot serve (dead, or stopped), or None; cheap, callable anytime."""
        return None  # one process: nothing to watch

    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a rank process ends (pidfds)."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Stop every rank; idempotent."""
