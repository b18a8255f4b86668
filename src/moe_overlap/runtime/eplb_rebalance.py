"""Online EPLB on a rank (``--enable-eplb``). At a step boundary the EP ranks sum their windows
of routed tokens per logical expert (one all-reduce), and each computes the same new placement
from the sum (``core/eplb_placement.rebalance`` is deterministic). Then the experts whose slot
changes move over the EP group: a slot whose new expert its rank already holds is copied on the
rank, the others arrive from the nearest rank that held the expert, in one all-to-all per expert
tensor. One chunk of layers moves per call. A layer's new weights are staged beside the old ones
and committed together with its replica map only once the whole chunk has arrived, so no forward
ever sees a half-moved layer. Every wait has the group's timeout: when a peer dies mid-move the
others raise (the collective's error, or ``CollectiveTimeout``) before their commit, and the
driver names the rank that died."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from torch import nn

from moe_overlap.core.eplb_placement import rebalance
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.distributed.groups import Group
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.moe_block import SparseMoeBlock

Row = tuple[int, ...]
# fault injection for the tests: "RANK:POINT" ends rank RANK's process at POINT of a move,
# "plan" (after the window's all-reduce) or "exchange" (after the first expert tensor crossed)
FAULT_ENV = "MOE_OVERLAP_EPLB_FAULT"
FAULT_EXIT = 75


def fault_point(rank: int, point: str) -> None:
    """Exit at once (no clean-up, as a killed process) where ``FAULT_ENV`` names this rank and
    ``point``: what a rank that dies mid-move looks like to its peers and the driver."""
    if os.environ.get(FAULT_ENV) == f"{rank}:{point}":
        os._exit(FAULT_EXIT)


@dataclass(frozen=True)
class Transfer:
    """Physical ``slot`` gets its new expert from ``src_slot``, which EP rank ``src`` holds."""

    layer: int
    slot: int
    src: int
    src_slot: int


@dataclass(frozen=True)
class MoveReport:
    """One call's work on one rank: the layers committed (their new ``physical_to_logical``),
    slots that changed expert (over every rank), bytes this rank sent, seconds, layers left."""

    rows: dict[int, Row]
    slots: int
    sent_bytes: int
    seconds: float
    left: int


def transfers(layer: int, old: Row, new: Row, ep: int) -> list[Transfer]:
    """Where every changed slot of ``layer`` takes its expert from: its own rank when that rank
    holds it already, else the nearest rank that held it (the lower slot on a tie). Every rank
    computes the same list."""
    per = len(old) // ep
    out = []
    for slot, expert in enumerate(new):
        if old[slot] == expert:
            continue
        dst = slot // per

        def distance(t: int, dst: int = dst) -> tuple[int, int]:
            ahead = (t // per - dst) % ep
            return min(ahead, ep - ahead), t

        src_slot = min((t for t, e in enumerate(old) if e == expert), key=distance)
        out.append(Transfer(layer, slot, src_slot // per, src_slot))
    return out


def expert_tensors(bank: ExpertBank) -> list[tuple[str, torch.Tensor]]:
    """The bank's per-slot tensors (weights, biases, scales: anything with a row per slot)."""
    named = list(bank.named_parameters(recurse=False)) + list(bank.named_buffers(recurse=False))
    return [(n, t) for n, t in named if t.dim() and t.shape[0] == bank.count]


class Rebalancer:
    """One rank's online EPLB: the layers still to move, and the move of a chunk of them."""

    def __init__(self, model: nn.Module, group: Group, placement: ExpertPlacement):
        assert placement.online is not None
        self.blocks = {m.layer_id: m for m in model.modules() if isinstance(m, SparseMoeBlock)}
        self.group, self.shape, self.algorithm = group, placement.online, placement.algorithm
        self.pending: dict[int, Row] = {}  # layers of the current rebalance not moved yet

    @classmethod
    def of(cls, model: nn.Module, group: Group, placement: ExpertPlacement | None):
        """The rank's rebalancer, or None where online EPLB is off."""
        if placement is None or placement.online is None:
            return None
        return cls(model, group, placement)

    def step(self, layers_per_chunk: int) -> MoveReport:
        """Move the next ``layers_per_chunk`` layers (0: all), planning a new placement from
        the window first when none is pending."""
        start = time.perf_counter()
        if not self.pending:
            self.pending = self._plan()
            fault_point(self.group.rank, "plan")
        chunk = sorted(self.pending)[: layers_per_chunk or None]
        rows = {layer: self.pending.pop(layer) for layer in chunk}
        moves = [
            t
            for layer, row in rows.items()
            for t in transfers(layer, self.blocks[layer].slots, row, self.group.size)
        ]
        sent = self._move(rows, moves)
        return MoveReport(rows, len(moves), sent, time.perf_counter() - start, len(self.pending))

    def restart_window(self) -> None:
        """Zero the window: the next placement balances the routing from here on."""
        for block in self.blocks.values():
            block.window.zero_()

    def _plan(self) -> dict[int, Row]:
        """Every layer whose placement changes, from the EP group's summed window (zeroed)."""
        layers = sorted(self.blocks)
        window = torch.stack([self.blocks[layer].window for layer in layers])
        self.group.all_reduce(window)
        for block in self.blocks.values():
            block.window.zero_()
        load = window.tolist()
        rows = rebalance(load, self.shape, self.algorithm) if window.any() else []
        return {
            layer: tuple(row)
            for layer, row in zip(layers, rows, strict=False)
            if tuple(row) != self.blocks[layer].slots
        }

    @torch.no_grad()
    def _move(self, rows: dict[int, Row], moves: list[Transfer]) -> int:
        """Stage every layer of ``rows``, fill it by ``moves``, then commit; bytes sent."""
        me, per = self.group.rank, self.shape.slots_per_gpu
        banks = {layer: self.blocks[layer].experts for layer in rows}
        staged = {
            layer: {n: t.clone() for n, t in expert_tensors(bank)} for layer, bank in banks.items()
        }
        for m in moves:  # on the rank: an expert it already holds in another slot
            if m.src == me == m.slot // per:
                bank = banks[m.layer]
                for name, t in expert_tensors(bank):
                    staged[m.layer][name][m.slot - bank.first] = t[m.src_slot - bank.first]
        crossing = [m for m in moves if m.src != m.slot // per]
        try:
            sent = self._exchange(banks, staged, crossing) if crossing else 0
        except BaseException as exc:  # a peer died or stalled: the staged rows are dropped
            exc.add_note(
                f"EPLB: rank {me}'s move of layers {sorted(rows)} stopped before its commit; "
                "they keep their old experts and replica map"
            )
            raise
        for layer, row in rows.items():  # commit: weights and map together
            block, bank = self.blocks[layer], banks[layer]
            for name, t in expert_tensors(bank):
                t.copy_(staged[layer][name])
            block.slots = row
            bank.logical = row[bank.first : bank.first + bank.count]
            assert block.replicas is not None  # online EPLB always dispatches through the map
            block.replicas.update(row)
        return sent

    def _exchange(
        self,
        banks: dict[int, ExpertBank],
        staged: dict[int, dict[str, torch.Tensor]],
        crossing: list[Transfer],
    ) -> int:
        """The experts that cross ranks, one all-to-all per expert tensor; bytes sent."""
        me, ep, per = self.group.rank, self.group.size, self.shape.slots_per_gpu
        sends = sorted((m.slot // per, m.layer, m.slot, m) for m in crossing if m.src == me)
        recvs = sorted((m.src, m.layer, m.slot, m) for m in crossing if m.slot // per == me)
        ins = [sum(1 for s in sends if s[0] == p) for p in range(ep)]
        outs = [sum(1 for r in recvs if r[0] == p) for p in range(ep)]
        sent = 0
        for name, like in expert_tensors(next(iter(banks.values()))):
            rows = [dict(expert_tensors(banks[m.layer]))[name][m.src_slot - banks[m.layer].first]
                    for *_, m in sends]  # fmt: skip
            width = like[0].numel()
            buf = torch.stack(rows).reshape(len(rows), width) if rows else like.new_empty(0, width)
            got = self.group.all_to_all(buf, ins, outs)
            assert isinstance(got, torch.Tensor)
            for row, (_, layer, slot, _) in zip(got, recvs, strict=True):
                staged[layer][name][slot - banks[layer].first] = row.view_as(like[0])
            sent += buf.numel() * buf.element_size()
            fault_point(me, "exchange")
        return sent
