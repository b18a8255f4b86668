"""A stand-in for an expert-parallel group whose peers do not exist (``bench --emulate-peers``).

The one real process is rank 0 of ``size`` ranks, and every peer is assumed to do what it does
(uniform load): a peer contributes to a reduction what this rank contributes, sends this rank
as many rows as this rank sends it, and so on. Nothing leaves the process: an all-to-all is a
device copy of the rows (the transfer's memory traffic), on the caller's stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_overlap.distributed.comm import CommHandle, Sending
from moe_overlap.distributed.groups import Group

_SAME_ON_EVERY_RANK = (dist.ReduceOp.MIN, dist.ReduceOp.MAX)


class EmulatedGroup(Group):
    """Rank 0 of an EP group of ``size`` ranks, its peers emulated by symmetry."""

    def __init__(self, size: int, device: torch.device, name: str = "ep") -> None:
        if size < 2:
            raise ValueError(f"an emulated group needs 2 or more ranks, not {size}")
        super().__init__([0], 0, None, name=name)
        self.ranks, self.device = list(range(size)), torch.device(device)
        self.rows_sent = 0  # every row of every all-to-all, to peers and to itself
        self.rows_received = 0
        self.rows_to_peers = 0  # the rows that would cross the link

    def __repr__(self) -> str:
        return f"EmulatedGroup({self.name!r}, rank 0 of {self.size}, {self.device})"

    def all_reduce(
        self,
        t: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> torch.Tensor | CommHandle:
        """Every peer holds ``t`` too: SUM scales it by the size, MIN and MAX keep it."""
        if op == dist.ReduceOp.SUM:
            t.mul_(self.size)
        elif op not in _SAME_ON_EVERY_RANK:
            raise ValueError(f"emulated all_reduce: {op} is not one of SUM, MIN, MAX")
        return self._run(None, t, "all_reduce", async_op)

    def gather_columns(self, column: torch.Tensor) -> torch.Tensor:
        """Every peer's column is this rank's."""
        return column.reshape(-1, 1).repeat(1, self.size)

    def all_gather(self, t: torch.Tensor, async_op: bool = False) -> torch.Tensor | CommHandle:
        """Every peer's ``t`` is this rank's."""
        return self._run(None, torch.cat([t] * self.size), "all_gather", async_op)

    def all_to_all(
        self,
        input: torch.Tensor,
        input_splits: list[int],
        output_splits: list[int],
        async_op: bool = False,
        p2p: bool | None = None,
    ) -> torch.Tensor | CommHandle:
        """Each peer sends back as many rows as it is sent: the output is a copy of ``input``,
        read as the rows that arrived from each peer in turn."""
        ins, outs = list(input_splits), list(output_splits)
        self._check_splits(input, ins, outs)
        if ins != outs:
            raise ValueError(
                f"emulated all_to_all: rank 0 sends {ins} rows but expects {outs}; emulated "
                "peers send back exactly what they are sent"
            )
        self.rows_sent += sum(ins)
        self.rows_received += sum(outs)
        self.rows_to_peers += sum(ins) - ins[self.rank]
        return self._run(None, input.clone(), "all_to_all", async_op)

    def barrier(self, timeout: float | None = None) -> None:
        """Nobody to wait for."""

    def reduce_scatter(
        self,
        t: torch.Tensor,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        async_op: bool = False,
    ) -> torch.Tensor | CommHandle:
        raise NotImplementedError(f"{self!r}: reduce_scatter is not emulated")

    def send_dict(self, tensors: dict[str, torch.Tensor], dst: int, wait: bool = True) -> Sending:
        raise NotImplementedError(f"{self!r}: emulated peers take no point-to-point sends")

    def recv_dict(self, src: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{self!r}: emulated peers send nothing point-to-point")
