"""The ``torch`` dispatcher backend: all-to-all over torch.distributed between EP ranks.

``dispatch_a`` sorts the (token, slot) pairs by expert, which groups them by owning rank,
exchanges the per-expert counts (a tiny synchronous all-to-all) and starts the async all-to-all
of hidden states; ``dispatch_b`` waits and regroups the received rows by local expert.
``combine_a`` starts sending the expert outputs back in the order they came; ``combine_b`` waits
and sums them per token exactly as the local backend does.
"""

from __future__ import annotations

import math
import time

import torch

from moe_overlap.moe.dispatch import DispatchState, weighted_sum


class _Linked:
    """An all-to-all handle that, over a modelled link, completes no sooner than the link would."""

    def __init__(self, handle, link, num_bytes: int):
        self.handle, self.link, self.num_bytes = handle, link, num_bytes
        self.start = time.perf_counter()
        self.earliest_end = self.start + (link.delay_for(num_bytes) if link is not None else 0.0)

    def wait(self) -> torch.Tensor:
        out = self.handle.wait()
        if self.link is not None:
            self.link.wait_until(self.start, self.num_bytes)
        return out


class AllToAllDispatcher:
    name = "torch"

    def __init__(self, group, num_experts: int, link=None, timeline=None):
        if num_experts % group.size:
            raise ValueError(f"--ep={group.size} does not divide num_experts={num_experts}")
        self.group, self.ep, self.link = group, group.size, link
        self.local = num_experts // group.size
        self.timeline = timeline  # records each all-to-all from launch to completion

    def _start(self, kind: str, rows: torch.Tensor, send: list[int], recv: list[int]) -> _Linked:
        me = self.group.rank
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        off_rank = max(sum(send) - send[me], sum(recv) - recv[me]) * row_bytes
        handle = self.group.all_to_all(rows, send, recv, async_op=True)
        linked = _Linked(handle, self.link, off_rank)
        timeline = self.timeline
        if timeline is not None and timeline.enabled:

            def done() -> None:
                end = max(time.perf_counter(), linked.earliest_end)
                timeline.add("comm", f"{kind} {off_rank / 1e6:.2f} MB", linked.start, end)

            handle.on_complete(done)
        return linked

    def dispatch_a(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> DispatchState:
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.ep * self.local).view(self.ep, self.local)
        # recv_counts[p, e]: rows rank p sends to my local expert e
        recv_counts = self.group.all_to_all(counts.contiguous(), [1] * self.ep, [1] * self.ep)
        send, recv = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        state = DispatchState(hidden.shape[0], topk_weights, order)
        state.extra.update(send=send, recv=recv, recv_counts=recv_counts)
        state.pending = self._start("dispatch", hidden[order // k], send, recv)
        return state

    def dispatch_b(self, state: DispatchState) -> None:
        received = state.pending.wait()
        state.pending = None
        recv_counts = state.extra["recv_counts"]
        # rows arrive grouped by source rank, then expert; regroup by expert, then source
        source = torch.repeat_interleave(torch.arange(recv_counts.numel()), recv_counts.reshape(-1))
        by_expert = source % self.local * self.ep + source // self.local
        perm = torch.argsort(by_expert, stable=True)
        state.extra["perm"] = perm
        state.expert_inputs = received[perm]
        state.tokens_per_expert = recv_counts.sum(0).tolist()

    def combine_a(self, state: DispatchState) -> None:
        outputs = torch.empty_like(state.expert_outputs)
        outputs[state.extra["perm"]] = state.expert_outputs  # back to the order they came in
        state.pending = self._start("combine", outputs, state.extra["recv"], state.extra["send"])

    def combine_b(self, state: DispatchState) -> torch.Tensor:
        return weighted_sum(state, state.pending.wait())
