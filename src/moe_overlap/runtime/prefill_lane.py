"""PD multiplexing on a rank: the prefill lane (SGLang's ``SPLIT_PREFILL``).

The lane runs a range of a prefill wave's layers on a thread of its own while the rank's main
thread runs the step's decode batch; on CUDA the lane also launches on a stream of its own,
joined to the caller's stream at both ends. Its MoE talks over a second
set of process groups (SGLang's PD-multiplexing TP group). Across ranks, the two lanes'
collectives take turns (``distributed/order.py``), so every rank launches them in one order,
as NCCL requires. Between steps it keeps the wave's hidden states and residual; the last range
returns the logits.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.distributed.order import CollectiveOrder
from moe_overlap.distributed.streams import MicroBatchStreams
from moe_overlap.overlap.operations import Op, Yield, execute_operations
from moe_overlap.overlap.strategy import build_operations, strategy_for


class PrefillLane:
    def __init__(self, runner, dispatcher: Dispatcher, order: CollectiveOrder | None = None):
        self.runner, self.dispatcher = runner, dispatcher
        self.stream = MicroBatchStreams(runner.kv_cache.device, count=1)  # no-op on CPU
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="prefill-lane")
        self.saved: dict[int, dict] = {}  # wave -> hidden states and residual after its range
        self._ops: dict[tuple[int, int], list[Op | Yield]] = {}
        self.order = order  # the lanes' turns across ranks; None in one process
        self.hidden: torch.Tensor | None = None  # the last wave's, where the model keeps them

    def ops(self, layers: range) -> list[Op | Yield]:
        key = (layers.start, layers.stop)
        if key not in self._ops:
            model = self.runner.model
            self._ops[key] = build_operations(model, strategy_for(model, NONE.name), layers=layers)
        return self._ops[key]

    def start(self, batch: ForwardBatch, layers: range, wave: int):
        """Run ``layers`` of ``wave`` on the lane's thread; ``finish`` waits for it."""
        self.stream.begin()
        if self.order is not None:
            self.order.begin(["decode", "prefill"])
        return self.thread.submit(self._run, batch, layers, wave)

    def decode_done(self) -> None:
        """The main thread's decode forward launches no more collectives this step."""
        if self.order is not None:
            self.order.end("decode")

    def finish(self, running) -> torch.Tensor | None:
        """The logits of the range ``start`` returned, after its last range (else None)."""
        logits = running.result()
        self.stream.end()
        return logits

    @torch.inference_mode()
    def _run(self, batch: ForwardBatch, layers: range, wave: int) -> torch.Tensor | None:
        r = self.runner
        ctx = ForwardContext(
            batch, r.kv_cache, self.dispatcher, name=tracks.PREFILL_LANE, timeline=r.timeline
        )
        inputs = self.saved.pop(wave, None) if layers.start else None
        try:
            with self.stream.on(0):
                out = execute_operations(ctx, self.ops(layers), inputs)
        finally:
            if self.order is not None:
                self.order.end("prefill")
        if "logits" in out:
            self.hidden = out.get("hidden")  # the wave's final hidden states: its MTP drafts'
            return out["logits"]
        self.saved = {wave: out}  # one wave at a time: an abandoned one is dropped here
        return None
