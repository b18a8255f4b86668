"""The token dispatcher's contract: send each token to the ranks owning its top-k experts and
bring the expert outputs back.

Each step is split in two (``_a`` starts, ``_b`` finishes) so that an overlap scheme can run
other work while the communication is in flight. Every backend starts with ``sort_by_expert``
and ends with ``weighted_sum``, in the same order of operations, so all give identical results.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Generic, Protocol, TypeVar

import torch

from moe_overlap.core import tracks
from moe_overlap.core.transfer import read_counts


class Pending(ABC):
    """Communication in flight. ``wait`` returns its rows; a second ``wait`` returns at once.

    ``waiter`` names the micro-batch that blocks on it (the owner's, by default: under DBO the
    other micro-batch runs the owner's receive as a hook)."""

    @abstractmethod
    def wait(self, waiter: str | None = None) -> torch.Tensor: ...


class Ready(Pending):
    """Nothing in flight: the rows are already here (one rank, no communication)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def wait(self, waiter: str | None = None) -> torch.Tensor:
        return self.rows


class WireForm(Protocol):
    """The form a dispatch's rows travel in (``dispatch/fp8_rows.py``): the run dtype's rows
    as they are, or FP8 rows with their scales, decoded where the experts need the run dtype."""

    fp8: bool

    def decode(self, rows: torch.Tensor) -> torch.Tensor: ...

    def empty_decoded(self, rows: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DispatchState:
    """One micro-batch's routing layout in one MoE layer, and its communication in flight.

    The rows that arrived for this rank's experts are ``arrived``, in the form they travelled
    (``wire``, where that is FP8): ``expert_inputs`` decodes them to the run dtype on first
    use, and an FP8 expert kernel may take them as they came (``model/moe.py``)."""

    num_tokens: int
    topk_weights: torch.Tensor  # [T, k]
    # (token, slot) pairs sorted by destination expert (none where the pairs go out unsorted)
    order: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    owner: str = tracks.FIRST  # the micro-batch this belongs to, for the timeline
    arrived: torch.Tensor | None = None  # rows grouped by local expert, as they travelled
    wire: WireForm | None = None  # FP8 rows: how to decode ``arrived`` (None: run dtype)
    # rows per local expert on the host; None while only the device has them (``counts``)
    tokens_per_expert: list[int] | None = None
    counts: torch.Tensor | None = None  # the same, on the device (the local backend)
    expert_outputs: torch.Tensor | None = None
    pending: Pending | None = None
    scattered: list[int] | None = None  # rows each attention-TP rank dispatched (scatter.py)
    # the low-latency layout: > 0 when ``expert_inputs`` is ``[ep, 1 + local * capacity,
    # hidden]`` (each source rank's block: a header row, then ``capacity`` rows per local
    # expert) and ``counts`` ``[ep, local]`` on the device says how many of each are real
    capacity: int = 0
    blocks: list[range] = field(default_factory=list)  # SBO's blocks of local experts

    def arrive(self, rows: torch.Tensor, wire: WireForm) -> None:
        """The dispatch delivered ``rows`` (grouped by local expert) in the form ``wire``."""
        self.arrived, self.wire = rows, wire if wire.fp8 else None

    @property
    def expert_inputs(self) -> torch.Tensor | None:
        """The arrived rows in the run dtype, decoded once, at the first call."""
        if self.wire is not None and self.arrived is not None:
            self.arrived, self.wire = self.wire.decode(self.arrived), None
        return self.arrived

    def empty_outputs(self) -> torch.Tensor:
        """Room for the experts' outputs: the arrived rows' layout, in the run dtype."""
        if self.arrived is None:
            raise RuntimeError(f"{self.owner}: the experts ran before the dispatch delivered")
        if self.wire is None:
            return torch.empty_like(self.arrived)
        return self.wire.empty_decoded(self.arrived)


def host_counts(state: DispatchState) -> list[int]:
    """Rows per local expert on the host. A backend that deferred the dispatch's one read of
    the device (the local one: a grouped GEMM takes the device's counts) reads them here, the
    first time something on the host needs them."""
    if state.tokens_per_expert is None:
        if state.counts is None:
            raise RuntimeError(f"{state.owner}: the experts' counts before the dispatch made them")
        state.tokens_per_expert = read_counts(state.counts, state.order.numel()).tolist()
    return state.tokens_per_expert


def in_flight(state: DispatchState) -> Pending:
    """The communication the last ``_a`` step started (a ``_b`` step waits on it)."""
    if state.pending is None:
        raise RuntimeError(f"{state.owner}: a _b step ran before its _a step started anything")
    return state.pending


def outputs(state: DispatchState) -> torch.Tensor:
    """The experts' output rows (set by the MoE before ``combine_a``)."""
    if state.expert_outputs is None:
        raise RuntimeError(f"{state.owner}: combine before the experts ran")
    return state.expert_outputs


S = TypeVar("S", bound=DispatchState)


class Dispatcher(ABC, Generic[S]):
    """A backend: ``local`` (one rank, every expert), ``torch`` (all-to-all over EP ranks) or
    ``none`` (a tensor-parallel MoE: gather, partial experts, all-reduce). ``S`` is the state
    its ``dispatch_a`` returns and its other steps take."""

    name: str
    num_experts: int  # routed experts over all ranks
    link: Any = None  # a backend's modelled link, if any (the link probe adds its time too)

    @abstractmethod
    def dispatch_a(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        owner: str = tracks.FIRST,
        extend: bool = True,
    ) -> S:
        """Sort the (token, slot) pairs by expert and start sending them to their owners.
        ``extend``: this micro-batch extends (prefill), which some backends' padding reads."""

    @abstractmethod
    def dispatch_b(self, state: S) -> None:
        """Wait for this rank's rows; fill ``expert_inputs`` and ``tokens_per_expert``."""

    @abstractmethod
    def combine_a(self, state: S) -> None:
        """Start sending ``expert_outputs`` back to the ranks the rows came from."""

    def combine_blocks(self, state: S, num_blocks: int) -> list[range]:
        """SBO's blocks of this rank's local experts, run in order, each one's outputs sent
        back as soon as it is done: ``balanced_blocks`` of the rows each expert received (the
        all-to-all backend: of the rows that cross ranks)."""
        state.blocks = balanced_blocks(host_counts(state), num_blocks)
        return state.blocks

    @abstractmethod
    def combine_a_block(self, state: S, block: int) -> None:
        """Start sending the outputs of block ``block`` of ``combine_blocks`` only (one SBO
        piece); every rank calls it for blocks 0, 1, ... in order."""

    def combine_b(self, state: S) -> torch.Tensor:
        """Wait for every output row and sum each token's outputs by its router weights."""
        return weighted_sum(state, in_flight(state).wait())


def balanced_blocks(rows: Sequence[int], num_blocks: int) -> list[range]:
    """Local experts ``0 .. len(rows) - 1`` in ``min(num_blocks, len(rows))`` contiguous blocks,
    the rows they hold as even as whole experts allow (each cut at the expert boundary nearest
    its share; by expert count when no expert has rows).

    Even rows, not even experts: the last block's piece goes back after every expert is done,
    so it is the part of the combine that SBO cannot hide, and with uneven routing an even
    count of experts can leave most of the rows there. The count depends only on the
    arguments' lengths, so every rank sends the same number of pieces.
    """
    local = len(rows)
    if local < 1 or num_blocks < 1:
        raise ValueError(f"need >= 1 expert and >= 1 block, got {local} and {num_blocks}")
    n = min(num_blocks, local)
    weights = list(rows) if sum(rows) > 0 else [1] * local
    ends, total = list(accumulate(weights, initial=0)), sum(weights)
    cuts = [0]
    for b in range(1, n):  # cut b nearest b/n of the rows, leaving each block >= 1 expert
        lo, hi = cuts[-1] + 1, local - (n - b)
        target = b * total
        cuts.append(min(range(lo, hi + 1), key=lambda j: abs(n * ends[j] - target)))
    cuts.append(local)
    return [range(a, z) for a, z in zip(cuts, cuts[1:], strict=False)]


def sort_by_expert(
    hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every backend's first step: the (token, slot) pairs sorted by expert (stable, so the
    order is the same on every backend), the hidden row of each, and rows per expert."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add_, not bincount: bincount sizes its output from the data, a read of the device
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    return order, hidden[order // topk_ids.shape[1]], counts


GATHER_ROWS = 4096  # from this many rows ``unsort`` gathers (fewer: one assignment, one launch)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: ``rows[inv]`` undoes ``rows[perm]``."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def unsort(rows: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``out`` with ``out[perm] = rows`` (``rows`` were ``x[perm]``: this gives ``x`` back).
    Many rows take the gather ``rows[inverse_permutation(perm)]``: on a GPU the indexed
    assignment runs CUDA's element-wise index kernel, which took 21% of the kernel time of a
    3072-token prefill at Qwen3-30B-A3B's shapes on an H200, where a gather of whole rows is
    vectorized. A decode step's few rows keep the assignment: one launch, not three. The bits
    are the same either way."""
    if rows.shape[0] >= GATHER_ROWS:
        return rows[inverse_permutation(perm)]
    out = torch.empty_like(rows)
    out[perm] = rows
    return out


def weighted_sum(state: DispatchState, sorted_outputs: torch.Tensor) -> torch.Tensor:
    """Undo the sort and sum each token's expert outputs weighted by its router scores."""
    return weigh(unsort(sorted_outputs, state.order), state.topk_weights)


def weigh(per_pair: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's expert outputs (``per_pair``: its k rows in a row, ``[T * k, hidden]``)
    summed by its router weights ``[T, k]``, in one order of operations for every backend."""
    t, k = weights.shape
    per_slot = per_pair.view(t, k, per_pair.shape[-1])
    return (per_slot * weights.to(per_slot.dtype).unsqueeze(-1)).sum(dim=1)
