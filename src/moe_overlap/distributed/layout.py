"""Parallel layouts: which global ranks form the TP, PP, EP, moe-TP, attention-TP and
attention-DP groups (SGLang's arithmetic). Pure arithmetic; no torch.distributed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moe_overlap.core.parallel_config import ParallelConfig

GROUP_KINDS = ("tp", "pp", "ep", "moe_tp", "attn_tp", "attn_dp")


@dataclass(frozen=True)
class RankCoords:
    """A global rank's position inside its group of every kind."""

    rank: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    moe_tp_rank: int
    attn_tp_rank: int
    attn_dp_rank: int


@dataclass
class ParallelLayout:
    """Every group of every kind as lists of global ranks; each kind partitions the world.

    The sizes are the effective ones: with pure expert parallelism ``dp == ep``.
    """

    world_size: int
    tp: int
    pp: int
    ep: int
    dp: int
    moe_tp: int
    attn_tp: int
    enable_dp_attention: bool
    pure_ep: bool
    tp_groups: list[list[int]]
    pp_groups: list[list[int]]
    ep_groups: list[list[int]]
    moe_tp_groups: list[list[int]]
    attn_tp_groups: list[list[int]]
    attn_dp_groups: list[list[int]]

    def groups(self, kind: str) -> list[list[int]]:
        """All groups of ``kind`` (one of ``GROUP_KINDS``)."""
        if kind not in GROUP_KINDS:
            raise KeyError(f"unknown group kind {kind!r}; expected one of {GROUP_KINDS}")
        return getattr(self, f"{kind}_groups")

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of ``kind`` that holds global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size={self.world_size}")
        return next(g for g in self.groups(kind) if rank in g)

    def coords(self, rank: int) -> RankCoords:
        """``rank``'s index inside each of its groups (tp_rank == rank % tp, and so on)."""
        pos = {f"{k}_rank": self.group_of(k, rank).index(rank) for k in GROUP_KINDS}
        return RankCoords(rank=rank, **pos)


def layout_for(par: ParallelConfig) -> ParallelLayout:
    """The whole world's layout: one replica's groups, repeated for every replica (each block
    of ``replica_size`` ranks), so that every kind still partitions the world. ``par`` is legal
    (``core/layout_rules.py: check_layout`` refuses the rest before any rank starts)."""
    one = _pure_ep_layout(par.ep) if par.pure_ep else _replica_layout(par)
    if par.replicas == 1:
        return one
    repeated: dict[str, Any] = {
        f"{kind}_groups": _repeat(one.groups(kind), par.replica_size, par.replicas)
        for kind in GROUP_KINDS
    }
    return dataclasses.replace(one, world_size=par.world_size, **repeated)


def _repeat(groups: list[list[int]], size: int, times: int) -> list[list[int]]:
    """``groups`` for each of ``times`` blocks of ``size`` ranks."""
    return [[r + k * size for r in g] for k in range(times) for g in groups]


def _runs(tp: int, pp: int, run: int) -> list[list[int]]:
    """Contiguous runs of ``run`` ranks inside each TP group."""
    return [list(range(s, s + run)) for i in range(pp) for s in range(i * tp, (i + 1) * tp, run)]


def _strided(tp: int, pp: int, stride: int) -> list[list[int]]:
    """Ranks ``stride`` apart inside each TP group: one rank from every contiguous run."""
    return [list(range(i * tp + j, (i + 1) * tp, stride)) for i in range(pp) for j in range(stride)]


def _replica_layout(par: ParallelConfig) -> ParallelLayout:
    """One replica's TP, PP, EP, moe-TP, attention-TP and attention-DP groups.

    SGLang's arithmetic: ``tp * pp`` ranks; TP groups are contiguous ranks, PP groups strided by
    ``tp``. ``moe_tp = tp // ep``; EP groups take ranks ``moe_tp`` apart inside a TP group (the
    TP group itself when ``ep == tp``), moe-TP groups are the contiguous runs of ``moe_tp``.
    Attention DP lives inside TP: ``attn_tp = tp // dp``, attention-TP groups are contiguous
    runs of ``attn_tp`` and attention-DP groups take ranks ``attn_tp`` apart.
    """
    tp, pp, ep, dp = par.tp, par.pp, par.ep, par.replica_attn_dp
    moe_tp, attn_tp, world_size = tp // ep, tp // dp, tp * pp
    return ParallelLayout(
        world_size=world_size,
        tp=tp,
        pp=pp,
        ep=ep,
        dp=dp,
        moe_tp=moe_tp,
        attn_tp=attn_tp,
        enable_dp_attention=par.enable_dp_attention,
        pure_ep=False,
        tp_groups=_runs(tp, pp, tp),
        pp_groups=[list(range(j, world_size, tp)) for j in range(tp)],
        ep_groups=_strided(tp, pp, moe_tp),
        moe_tp_groups=_runs(tp, pp, moe_tp),
        attn_tp_groups=_runs(tp, pp, attn_tp),
        attn_dp_groups=_strided(tp, pp, attn_tp),
    )


def _pure_ep_layout(ep: int) -> ParallelLayout:
    """Pure expert parallelism (``--tp 1 --ep N``): ``ep`` ranks, one EP group of all of them,
    every rank its own attention-DP rank (``attn_tp == 1``, effective ``dp == ep``) and no
    dense tensor parallelism."""
    alone = [[r] for r in range(ep)]
    everyone = [list(range(ep))]
    return ParallelLayout(
        world_size=ep,
        tp=1,
        pp=1,
        ep=ep,
        dp=ep,
        moe_tp=1,
        attn_tp=1,
        enable_dp_attention=True,
        pure_ep=True,
        tp_groups=alone,
        pp_groups=[list(g) for g in alone],
        ep_groups=everyone,
        moe_tp_groups=[list(g) for g in alone],
        attn_tp_groups=[list(g) for g in alone],
        attn_dp_groups=[list(g) for g in everyone],
    )
