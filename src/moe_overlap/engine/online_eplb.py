"""Online EPLB, driver side (``--enable-eplb``): count the steps, and every
``--eplb-rebalance-num-iterations`` of them, at the boundary after a step, ask the ranks to move
their experts (``runtime/eplb_rebalance.py``), one chunk of layers per boundary until the new
placement is in; with ``--eplb-window-size`` W, the ranks restart their windows W steps before
each rebalance. Each move is logged and counted (``/metrics``: ``moe_overlap_eplb_*``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.engine.eplb_args import EplbArgs
from moe_overlap.runtime.executor import Executor

logger = logging.getLogger("moe_overlap.eplb")


@dataclass
class EplbStats:
    """What online EPLB has done so far: rebalances finished, layers and slots whose experts
    moved, bytes sent between ranks, and the seconds the moves took (the slowest rank's)."""

    rebalances: int = 0
    layers_moved: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0


class OnlineEplb:
    """The driver's clock for online EPLB, and the placement the ranks serve now."""

    def __init__(
        self,
        every: int,
        per_chunk: int,
        executor: Executor,
        placement: ExpertPlacement,
        window: int | None = None,
    ):
        self.every, self.per_chunk, self.executor = every, per_chunk, executor
        self.window = window if window is not None and window < every else None
        self.placement = placement
        self.steps = 0
        self.moving = False  # a rebalance is part way: the next boundary moves the next chunk
        self.stats = EplbStats()

    @classmethod
    def of(
        cls, args: EplbArgs, executor: Executor, placement: ExpertPlacement | None
    ) -> OnlineEplb | None:
        if not args.enable_eplb:
            return None
        if placement is None or not executor.moves_experts:
            executor.close()
            raise ConfigError(
                "--enable-eplb moves experts between ranks this process spawned (--ep >= 2); "
                "a torchrun launch or one process cannot: drop --enable-eplb"
            )
        per_chunk = args.eplb_rebalance_layers_per_chunk or 0
        every, window = args.eplb_rebalance_num_iterations, args.eplb_window_size
        return cls(every, per_chunk, executor, placement, window)

    def after_step(self) -> bool:
        """Count a step; at a rebalance's boundary move a chunk. True when layers moved."""
        self.steps += 1
        if self.window is not None and self.steps % self.every == self.every - self.window:
            self.executor.restart_expert_window()  # the next placement sees W steps only
        if not self.moving and self.steps % self.every:
            return False
        reports = self.executor.rebalance_experts(self.per_chunk)
        rows = reports[0].rows  # every rank computed the same placement
        self.moving = reports[0].left > 0
        sent = sum(r.sent_bytes for r in reports)
        seconds = max(r.seconds for r in reports)
        s = self.stats
        s.rebalances += not self.moving
        s.layers_moved += len(rows)
        s.slots_moved += reports[0].slots
        s.bytes_moved += sent
        s.seconds += seconds
        logger.info(
            "EPLB rebalance at step %d: layers %s moved (%d slots, %.3f MB between ranks, "
            "%.1f ms)%s",
            self.steps,
            sorted(rows) or "no layer",
            reports[0].slots,
            sent / 1e6,
            seconds * 1e3,
            f", {reports[0].left} layers still to move" if self.moving else "",
        )
        if rows:
            self.placement = self.placement.moved(rows)
        return bool(rows)


# /metrics' gauges of online EPLB (``EngineLoop.stats`` keys), each with its help
EPLB_GAUGES = {
    "eplb_rebalances": "Online EPLB rebalances finished since the start (--enable-eplb)",
    "eplb_layers_moved": "MoE layers whose experts online EPLB moved, summed over rebalances",
    "eplb_bytes_moved": "Bytes of expert weights online EPLB sent between ranks",
}


def eplb_counts(eplb: OnlineEplb | None) -> dict[str, int]:
    """``EPLB_GAUGES``' values (zeros without online EPLB)."""
    s = eplb.stats if eplb is not None else EplbStats()
    return dict(zip(EPLB_GAUGES, (s.rebalances, s.layers_moved, s.bytes_moved), strict=True))
