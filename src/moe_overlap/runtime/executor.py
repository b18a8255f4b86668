"""The executor contract: run one step's per-rank batches on however many ranks there are.

``LocalExecutor`` (one process), ``SpawnedExecutor`` (rank processes started here) and
``TorchrunExecutor`` (a torchrun launch, one or several machines) implement it; ``LLM`` and the
bench talk to every one of them the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.step import StepReply, StepRequest


class Executor(ABC):
    num_ranks: int  # processes
    # batches per step, one per attention-DP group; rank r runs batch r // (num_ranks / num_dp)
    num_dp: int
    is_driver: bool = True  # False on torchrun ranks > 0, which only serve rank 0's steps
    moves_experts: bool = False  # online EPLB: rebalance_experts runs here

    @abstractmethod
    def step(self, request: StepRequest) -> StepReply:
        """Run one step: ``request.batches[d]`` on data-parallel group d's ranks (and a
        prefill wave's layer range beside it); each group's answering rank samples."""

    def run(
        self,
        batches: list[ForwardBatch],
        overlap: OverlapConfig | None = None,
        record: bool = False,
    ) -> StepReply:
        """A forward-only step: every group's logit rows come back (``reply.logits``), and
        with ``record`` each rank's timeline spans (``reply.spans``)."""
        return self.step(StepRequest(batches, None, overlap, record))

    def probe(self, num_bytes: int, repeats: int = 5, p2p: bool | None = None) -> list[list[float]]:
        """Per rank, the seconds of each all-to-all of ``num_bytes`` over the engine's link."""
        raise ConfigError("probing the link needs 2 or more ranks (--ep or --tp)")

    def expert_load(self, action: str) -> list[dict[int, list[int]] | None]:
        """The expert-distribution recorder on every rank (``runtime/expert_load.py``): per
        rank, for ``read``, each MoE layer's rows sent to each physical slot."""
        raise ConfigError("the expert-distribution recorder runs on spawned or local ranks")

    def rebalance_experts(self, layers_per_chunk: int) -> list:
        """Online EPLB (``runtime/eplb_rebalance.py``): every rank moves the next chunk of
        layers of its placement (planning a new one first if none is pending); per rank, its
        ``MoveReport``."""
        raise ConfigError("--enable-eplb moves experts between spawned ranks (--ep >= 2)")

    def restart_expert_window(self) -> None:
        """Online EPLB's ``--eplb-window-size``: every rank zeroes its window of routed
        tokens, so the next placement balances the steps from here on."""
        raise ConfigError("--enable-eplb moves experts between spawned ranks (--ep >= 2)")

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
