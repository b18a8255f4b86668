"""A Group wrapper for collectives, and the process groups of a layout.

``init_process_groups`` turns a layout into one ``Group`` per kind for the calling rank. A
``Group`` of one rank has no process group at all, so the single-process code path never
initialises ``torch.distributed``.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_overlap.core import tracks
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.timeline import Timeline
from moe_overlap.distributed.comm import (
    CollectiveTimeout,
    CommHandle,
    Sending,
    Work,
    abort_process_groups,
    all_to_all_p2p,
    default_group_timeout,
    issued,
)
from moe_overlap.distributed.layout import GROUP_KINDS, ParallelLayout
from moe_overlap.distributed.order import CollectiveOrder, ordered, refuse_if_aborted

# torch 2.13 names them *_single and deprecates the older names, which torch <= 2.11 needs
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Group:
    """A set of global ranks and the process group that connects them.

    Ranks passed to ``send_dict``/``recv_dict`` are group-local. With ``pg=None`` the group
    must hold one rank, and every operation is an identity (in place) or a copy.
    """

    def __init__(
        self,
        ranks: list[int],
        global_rank: int,
        pg: dist.ProcessGroup | None = None,
        *,
        backend: str = "gloo",
        timeout: timedelta = dist.default_pg_timeout,
        name: str = "",
    ) -> None:
        if global_rank not in ranks:
            raise ValueError(f"rank {global_rank} is not in group {name!r} {ranks}")
        if pg is None and len(ranks) != 1:
            raise ValueError(f"group {name!r} {ranks} has several ranks but no process group")
        self.ranks, self.global_rank, self.pg = list(ranks), global_rank, pg
        self.backend, self.timeout, self.name = str(backend), timeout, name
        # set on the attention-TP group: its blocking collectives land on the "tp comm" track
        self.timeline: Timeline | None = None
        self.order: CollectiveOrder | None = None  # PD multiplexing: turns with another lane
        self.aborted = ""  # why the group was given up (``abort``): every collective refuses
        self.lane = "main"  # which lane of the rank this group's collectives belong to
        on_cuda = "nccl" in self.backend  # "nccl", or "cpu:gloo,cuda:nccl" (core/device.py)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        )

    def abort(self, reason: str) -> None:
        """Give up on the group (a thread was left inside one of its collectives): every later
        collective raises ``CollectiveAborted`` at once, never pairing with a peer's later
        one; on NCCL the process's communicators are aborted (``abort_process_groups``). A
        group of one rank has no peer to pair with: nothing changes."""
        if self.pg is None:
            return
        self.aborted = reason
        if self.device.type == "cuda":
            abort_process_groups()

    @classmethod
    def single(cls, global_rank: int = 0, name: str = "") -> Group:
        """A one-rank group that needs no ``torch.distributed`` initialisation."""
        return cls([global_rank], global_rank, None, name=name)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, rank={self.rank}, {self.backend})"

    def _wait(self, work: Work, op: str, timeout: float | None) -> None:
        limit = self.timeout if timeout is None else timedelta(seconds=timeout)
        try:
            finished = work.wait(timeout=limit)
        except RuntimeError as e:
            text = str(e).lower()
            if "timed out" not in text and "timeout" not in text:
                raise
            raise self._timeout_error(op, limit) from e
        if finished is False:  # a backend may report an expired wait this way
            raise self._timeout_error(op, limit)

    def _timeout_error(self, op: str, limit: timedelta) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"{op} on group {self.name!r} (global ranks {self.ranks}) did not finish within "
            f"{limit.total_seconds():g} s on rank {self.global_rank}: a peer never joined or is "
            "stuck; the group is unusable now"
        )

    def _run(
        self, work: Work | None, output: torch.Tensor, op: str, async_op: bool
    ) -> torch.Tensor | CommHandle:
        handle = CommHandle(self._wait, work, output, op)
        if async_op:
            return handle
        if self.timeline is None or not self.timeline.enabled or work is None:
            return handle.wait()
        start = time.perf_counter()
        out = handle.wait()
        self.timeline.add(tracks.TP_COMM, f"{self.name} {op}", start, time.perf_counter())
        return out

    @ordered
    def all_reduce(
        self,
        t: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> torch.Tensor | CommHandle:
        """Reduce contiguous ``t`` in place across the group; returns ``t`` (or a handle to it)."""
        work = None if self.pg is None else dist.all_reduce(t, op, self.pg, async_op=True)
        return self._run(work, t, "all_reduce", async_op)

    def gather_columns(self, column: torch.Tensor) -> torch.Tensor:
        """Every rank's ``column`` side by side (``[len, size]``, group-rank order), by one
        all-reduce (SUM) of a table holding only this rank's (vLLM's agreement tables)."""
        table = column.new_zeros((column.shape[0], self.size))
        table[:, self.rank] = column
        return self.all_reduce(table) if self.size > 1 else table

    @ordered
    def all_gather(self, t: torch.Tensor, async_op: bool = False) -> torch.Tensor | CommHandle:
        """Every rank's ``t`` (same shape on all) concatenated along dim 0, in group-rank order."""
        if self.pg is None:
            return self._run(None, t.clone(), "all_gather", async_op)
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        work = _all_gather(out, t.contiguous(), self.pg, async_op=True)
        return self._run(work, out, "all_gather", async_op)

    @ordered
    def reduce_scatter(
        self,
        t: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> torch.Tensor | CommHandle:
        """Reduce ``t`` across the group and return this rank's slice of dim 0 (a new tensor)."""
        if t.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter: dim 0 of {tuple(t.shape)} is not divisible by {self.size}"
            )
        if self.pg is None:
            return self._run(None, t.clone(), "reduce_scatter", async_op)
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        work = _reduce_scatter(out, t.contiguous(), op, self.pg, async_op=True)
        return self._run(work, out, "reduce_scatter", async_op)

    @ordered
    def all_to_all(
        self,
        input: torch.Tensor,
        input_splits: list[int],
        output_splits: list[int],
        async_op: bool = False,
        p2p: bool | None = None,
    ) -> torch.Tensor | CommHandle:
        """Send ``input_splits[p]`` rows of ``input`` (in order) to group rank ``p``; receive
        ``output_splits[p]`` rows from each. Splits may be uneven or zero."""
        self._check_splits(input, list(input_splits), list(output_splits))
        if self.pg is None:
            return self._run(None, input.clone(), "all_to_all", async_op)
        out = input.new_empty((sum(output_splits), *input.shape[1:]))
        if p2p if p2p is not None else not input.is_cuda:  # gloo carries CPU tensors
            works = all_to_all_p2p(self.pg, self.ranks, out, input, input_splits, output_splits)
            return self._run(works, out, "all_to_all", async_op)
        work = dist.all_to_all_single(
            out, input.contiguous(), list(output_splits), list(input_splits), self.pg, async_op=True
        )
        return self._run(work, out, "all_to_all", async_op)

    def _check_splits(self, input: torch.Tensor, ins: list[int], outs: list[int]) -> None:
        if len(ins) != self.size or len(outs) != self.size:
            raise ValueError(f"all_to_all: need {self.size} splits, got {ins} and {outs}")
        if min(ins + outs) < 0 or sum(ins) != input.shape[0]:
            raise ValueError(
                f"all_to_all: input_splits {ins} must be >= 0 and sum to {input.shape[0]} rows"
            )
        if ins[self.rank] != outs[self.rank]:  # gloo would fail later with an opaque enforce
            raise ValueError(
                f"all_to_all: rank {self.rank} sends itself {ins[self.rank]} rows "
                f"but expects {outs[self.rank]}"
            )

    @ordered
    def barrier(self, timeout: float | None = None) -> None:
        """Wait until every rank of the group arrives."""
        if self.pg is not None:
            self._wait(dist.barrier(self.pg, async_op=True), "barrier", timeout)

    def send_dict(self, tensors: dict[str, torch.Tensor], dst: int, wait: bool = True) -> Sending:
        """Send named tensors to group rank ``dst``: metadata (names, shapes, dtypes), then data.
        With ``wait=False`` return at once; the returned ``Sending``'s ``wait`` waits for the
        sends (with ``wait=True`` they are done, and it returns at once)."""
        self._check_peer(dst)
        meta = [[k, list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in tensors.items()]
        blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        frames = [torch.tensor([blob.numel()]), blob] + list(tensors.values())
        frames = [f.to(self.device).contiguous() for f in frames]
        works = [issued(dist.isend(f, group=self.pg, group_dst=dst)) for f in frames if f.numel()]
        sending = Sending(self._wait, works, frames, dst)
        if wait:
            sending.wait()
        return sending

    def recv_dict(self, src: int) -> dict[str, torch.Tensor]:
        """Receive what ``send_dict`` on group rank ``src`` sent, on this group's device."""
        self._check_peer(src)
        length = self._recv(torch.empty(1, dtype=torch.int64, device=self.device), src)
        blob = self._recv(torch.empty(int(length), dtype=torch.uint8, device=self.device), src)
        meta = json.loads(bytes(blob.cpu().tolist()).decode())
        out = {k: torch.empty(s, dtype=getattr(torch, d), device=self.device) for k, s, d in meta}
        works = [
            issued(dist.irecv(t, group=self.pg, group_src=src)) for t in out.values() if t.numel()
        ]
        for work in works:
            self._wait(work, f"recv_dict from group rank {src}", None)
        return out

    def _recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        work = issued(dist.irecv(t, group=self.pg, group_src=src))
        self._wait(work, f"recv_dict from group rank {src}", None)
        return t

    def _check_peer(self, peer: int) -> None:
        refuse_if_aborted(self)
        if self.pg is None or not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"{self!r} has no peer group rank {peer}")


def init_process_groups(
    layout: ParallelLayout, rank: int, backend: str, timeout: timedelta | None = None
) -> dict[str, Group]:
    """Create every group of ``layout`` and return this rank's, keyed by kind plus ``"world"``.

    Every rank must call this: ``dist.new_group`` runs for every distinct multi-rank group in
    the same order everywhere. Kinds with identical ranks share one process group, one-rank
    groups get none. ``timeout`` defaults to the one given to ``dist.init_process_group``.
    """
    if not dist.is_initialized() or dist.get_world_size() != layout.world_size:
        raise ConfigError(
            f"init_process_groups needs dist.init_process_group with world_size="
            f"{layout.world_size} first"
        )
    timeout = timeout or default_group_timeout()
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for kind in GROUP_KINDS:
        for ranks in layout.groups(kind):
            if len(ranks) > 1 and tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout, backend=backend)
    groups = {
        kind: Group(
            ranks, rank, made.get(tuple(ranks)), backend=backend, timeout=timeout, name=kind
        )
        for kind in GROUP_KINDS
        for ranks in [layout.group_of(kind, rank)]
    }
    world = list(range(layout.world_size))
    wpg = dist.group.WORLD if layout.world_size > 1 else None
    groups["world"] = Group(world, rank, wpg, backend=backend, timeout=timeout, name="world")
    return groups
