"""The ``none`` backend (SGLang's name: no all-to-all): a tensor-parallel MoE.

Every rank of the TP world sees every token: ``dispatch_a`` starts the ``dp_gather`` of the
attention-DP groups' tokens (with their routing), each rank runs the pairs routed to its own
experts over its moe-TP slice of their width, and ``combine_a`` starts the all-reduce that sums
the partial outputs over experts and slices; ``combine_b`` keeps this group's rows
(``dp_scatter``). Without DP attention the tokens are already on every rank and only the
all-reduce remains.

The gather pads like SGLang's ``DpPaddingMode``: ``sum`` (each group's rows at its offset, the
others zero, all-reduced) whenever a batch extends, else whichever moves fewer bytes: ``max``
(every group padded to the longest, all-gathered) when ``2 * sum > max * dp``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from moe_overlap.core import tracks
from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.dispatcher import (
    Dispatcher,
    DispatchState,
    Pending,
    Ready,
    host_counts,
    in_flight,
    outputs,
)
from moe_overlap.core.timeline import Timeline
from moe_overlap.core.transfer import read_counts
from moe_overlap.dispatch.fp8_rows import PlainRows
from moe_overlap.dispatch.in_flight import InFlight
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.modelled_link import ModelledLink


def dp_padding_mode(lens: list[int], extend: bool) -> str:
    """SGLang's rule: ``sum`` (all-reduce) for extends, else the cheaper of the two."""
    if extend:
        return "sum"
    return "max" if 2 * sum(lens) > max(lens) * len(lens) else "sum"


class Summed(Pending):
    """Several partial outputs in flight (SBO's blocks); ``wait`` returns their sum."""

    def __init__(self, parts: list[Pending]):
        self.parts = parts

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        total = self.parts[0].wait(waiter)
        for part in self.parts[1:]:
            total = total + part.wait(waiter)
        self.parts = [Ready(total)]
        return total


@dataclass(kw_only=True)
class GatherState(DispatchState):
    lens: list[int]  # tokens of each attention-DP group
    mode: str = "replicated"  # replicated | sum | max
    all_weights: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0))  # [N, k] of all


class GatherDispatcher(Dispatcher[GatherState]):
    name = Backend.NONE

    def __init__(
        self,
        tp: Group,
        attn_dp: Group,
        attn_tp_rank: int,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        link: ModelledLink | None = None,
        timeline: Timeline | None = None,
        wire: PlainRows | None = None,
    ):
        self.tp, self.attn_dp, self.leader = tp, attn_dp, attn_tp_rank == 0
        self.wire = wire or PlainRows()  # --moe-dispatch-dtype: the gathered rows' form
        self.num_experts, self.local = num_experts, num_experts // ep_size
        self.first = ep_rank * self.local
        self.link, self.timeline = link, timeline

    def _flight(self, handle, kind: str, num_bytes: int, owner: str) -> InFlight:
        label = f"{kind} {num_bytes / 1e6:.2f} MB ({owner})"
        return InFlight(handle, self.link, num_bytes, owner, self.timeline, label)

    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> GatherState:
        n = hidden.shape[0]
        packed = pack_routing(self.wire.encode(hidden), topk_weights, topk_ids)
        no_order = torch.empty(0, dtype=torch.long)
        if self.attn_dp.size == 1:
            state = GatherState(n, topk_weights, no_order, owner, lens=[n])
            state.pending = Ready(packed)
            return state
        info = self.attn_dp.all_gather(torch.tensor([[n, int(extend)]]))
        state = GatherState(n, topk_weights, no_order, owner, lens=info[:, 0].tolist())
        state.mode = dp_padding_mode(state.lens, bool(info[:, 1].any()))
        total, longest, width = sum(state.lens), max(state.lens), packed.shape[1]
        if total == 0:  # every group idle: nothing to move
            state.pending = Ready(packed)
        elif state.mode == "sum":
            buf = packed.new_zeros(total, width)
            if self.leader:  # one rank per group writes its rows; the others add zeros
                start = sum(state.lens[: self.attn_dp.rank])
                buf[start : start + n] = packed
            nbytes = _ring_bytes(buf, self.tp.size, reduce=True)
            handle = self.tp.all_reduce(buf, async_op=True)
            state.pending = self._flight(handle, "dp-gather all-reduce", nbytes, owner)
        else:
            buf = packed.new_zeros(longest, width)
            buf[:n] = packed
            nbytes = buf.numel() * buf.element_size() * (self.attn_dp.size - 1)
            handle = self.attn_dp.all_gather(buf, async_op=True)
            state.pending = self._flight(handle, "dp-gather all-gather", nbytes, owner)
        return state

    def dispatch_b(self, state: GatherState) -> None:
        rows = in_flight(state).wait()
        state.pending = None
        if state.mode == "max":
            longest = max(state.lens)
            rows = torch.cat(
                [rows[d * longest : d * longest + n] for d, n in enumerate(state.lens)]
            )
        k = state.topk_weights.shape[1]
        hidden, weights, ids = unpack_routing(rows, k)
        local = ids.reshape(-1).long() - self.first  # pair -> my local expert, if it is mine
        # pairs of other ranks' experts sort last, under key ``self.local``: my pairs come
        # first, by expert (stable: by pair within one), and the one read of the device, the
        # counts, says how many there are (no nonzero, no boolean mask, no bincount)
        key = torch.where((local >= 0) & (local < self.local), local, self.local)
        counts = key.new_zeros(self.local + 1).scatter_add_(0, key, torch.ones_like(key))
        state.tokens_per_expert = read_counts(counts[:-1], key.numel()).tolist()
        state.order = torch.argsort(key, stable=True)[: sum(state.tokens_per_expert)]
        state.all_weights = weights
        state.arrive(hidden[state.order // k], self.wire)

    def _partial(self, state: GatherState, rows: slice) -> Pending:
        """Start summing the weighted outputs of ``rows`` of ``expert_outputs`` over the world."""
        weights = state.all_weights.reshape(-1)
        k = state.all_weights.shape[1]
        pairs = state.order[rows]
        expert_outputs = outputs(state)
        out = expert_outputs.new_zeros(state.all_weights.shape[0], expert_outputs.shape[1])
        out.index_add_(0, pairs // k, expert_outputs[rows] * weights[pairs, None].to(out.dtype))
        if self.tp.size == 1 or not out.numel():
            return Ready(out)
        nbytes = _ring_bytes(out, self.tp.size, reduce=True)
        return self._flight(
            self.tp.all_reduce(out, async_op=True), "moe all-reduce", nbytes, state.owner
        )

    def combine_a(self, state: GatherState) -> None:
        state.pending = self._partial(state, slice(None))

    def combine_a_block(self, state: GatherState, block: int) -> None:
        experts = state.blocks[block]  # every rank holds the same rows, so the same blocks
        ends = list(accumulate(host_counts(state), initial=0))
        part = self._partial(state, slice(ends[experts.start], ends[experts.stop]))
        if isinstance(state.pending, Summed):
            state.pending.parts.append(part)
        else:
            state.pending = Summed([part])

    def combine_b(self, state: GatherState) -> torch.Tensor:
        out = in_flight(state).wait()
        start = sum(state.lens[: self.attn_dp.rank]) if self.attn_dp.size > 1 else 0
        return out[start : start + state.num_tokens]


def pack_routing(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's row with its router weights and expert ids, one tensor to gather: in the
    rows' dtype (ids as floats: exact below 2**24 experts), or as bytes beside FP8 rows' bytes
    (the gather's all-reduce adds zeros to one rank's bytes, so they arrive unchanged)."""
    if rows.dtype != torch.uint8:
        return torch.cat((rows, weights.to(rows.dtype), ids.to(rows.dtype)), 1)
    as_bytes = [t.contiguous().view(torch.uint8) for t in (weights.float(), ids.int())]
    return torch.cat((rows, *as_bytes), 1)


def unpack_routing(packed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_routing``'s rows, weights ``[n, k]`` and ids ``[n, k]`` (ids as floats, or int32)."""
    width = packed.shape[1]
    if packed.dtype != torch.uint8:
        rows, weights, ids = packed.split([width - 2 * k, k, k], dim=1)
        return rows, weights, ids
    rows, weights, ids = packed.split([width - 8 * k, 4 * k, 4 * k], dim=1)
    return rows, weights.contiguous().view(torch.float32), ids.contiguous().view(torch.int32)


def _ring_bytes(t: torch.Tensor, ranks: int, reduce: bool) -> int:
    """Bytes one rank sends in a ring all-reduce (twice an all-gather's share)."""
    share = t.numel() * t.element_size() * (ranks - 1) // ranks
    return 2 * share if reduce else share
