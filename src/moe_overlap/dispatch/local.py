"""The ``local`` dispatcher backend: one rank holds every expert, nothing is sent."""

from __future__ import annotations

import torch

from moe_overlap.core import tracks
from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.dispatcher import Dispatcher, DispatchState, Ready, outputs, sort_by_expert
from moe_overlap.dispatch.fp8_rows import PlainRows


class LocalDispatcher(Dispatcher[DispatchState]):
    name = Backend.LOCAL

    def __init__(self, num_experts: int, wire: PlainRows | None = None):
        self.num_experts = num_experts
        self.wire = wire or PlainRows()  # --moe-dispatch-dtype: quantized where it would be sent

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> DispatchState:
        # the rows in the form they would travel in (FP8: quantized where they would be sent)
        order, rows, counts = sort_by_expert(self.wire.encode(hidden), topk_ids, self.num_experts)
        state = DispatchState(hidden.shape[0], topk_weights, order, owner, counts=counts)
        # the counts stay on the device: a grouped GEMM takes them there (no read, and a
        # CUDA graph can hold the step); other paths read them once (``host_counts``)
        state.arrive(rows, self.wire)
        state.pending = Ready(rows)
        return state

    def dispatch_b(self, state: DispatchState) -> None:
        pass  # nothing in flight

    def combine_a(self, state: DispatchState) -> None:
        state.pending = Ready(outputs(state))

    def combine_a_block(self, state: DispatchState, block: int) -> None:
        state.pending = Ready(outputs(state))  # the outputs are already in place
