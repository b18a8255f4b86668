"""Parallel layouts: which global ranks form the TP, PP, EP, moe-TP, attention-TP and
attention-DP groups (SGLang's arithmetic). Pure arithmetic; no torch.distributed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moe_overlap.core.errors import ConfigError
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
    of ``replica_size`` ranks), so that every kind still partitions the world."""
    one = compute_layout(
        par.replica_size,
        1 if par.pure_ep else par.tp,
        par.pp,
        par.ep,
        par.dp if par.replicas == 1 else 1,
        par.enable_dp_attention,
    )
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


def _divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def _runs(tp: int, pp: int, run: int) -> list[list[int]]:
    """Contiguous runs of ``run`` ranks inside each TP group."""
    return [list(range(s, s + run)) for i in range(pp) for s in range(i * tp, (i + 1) * tp, run)]


def _strided(tp: int, pp: int, stride: int) -> list[list[int]]:
    """Ranks ``stride`` apart inside each TP group: one rank from every contiguous run."""
    return [list(range(i * tp + j, (i + 1) * tp, stride)) for i in range(pp) for j in range(stride)]


def compute_layout(
    world_size: int, tp: int, pp: int, ep: int, dp: int, enable_dp_attention: bool
) -> ParallelLayout:
    """Place ``world_size`` ranks into TP, PP, EP, moe-TP, attention-TP and attention-DP groups.

    SGLang's rules: ``world_size == tp * pp``; TP groups are contiguous ranks, PP groups strided
    by ``tp``. ``ep`` divides ``tp``, ``moe_tp = tp // ep``; EP groups take ranks ``moe_tp``
    apart inside a TP group (the TP group itself when ``ep == tp``), moe-TP groups are the
    contiguous runs of ``moe_tp``. Attention DP lives inside TP: ``dp`` divides ``tp``,
    ``attn_tp = tp // dp``, attention-TP groups are contiguous runs of ``attn_tp`` and
    attention-DP groups take ranks ``attn_tp`` apart; ``dp > 1`` needs ``enable_dp_attention``.

    Pure expert parallelism (our ``LLM(ep=N)``): ``tp == pp == 1`` and ``ep > 1`` means
    ``world_size == ep`` ranks, one EP group of all ranks, every rank its own attention-DP rank
    (``attn_tp == 1``, effective ``dp == ep``) and no dense tensor parallelism; ``dp`` may be
    given as 1 or ``ep``, and ``enable_dp_attention`` is implied.

    Raises ``ConfigError`` naming the values and a fix for every impossible combination.
    """
    sizes = {"world_size": world_size, "--tp": tp, "--pp": pp, "--ep": ep, "--dp": dp}
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if tp == 1 and pp == 1 and ep > 1:
        return _pure_ep_layout(world_size, ep, dp)
    if world_size != tp * pp:
        hint = f" or --pp={world_size // tp}" if world_size % tp == 0 else ""
        raise ConfigError(
            f"world_size={world_size} must equal --tp * --pp = {tp} * {pp} = {tp * pp} "
            f"(dp lives inside tp); launch {tp * pp} ranks{hint}"
        )
    if tp % ep:
        raise ConfigError(
            f"--ep={ep} does not divide --tp={tp}; choose ep in {_divisors(tp)}"
            + (" (or --tp=1 --pp=1 for pure expert parallelism)" if pp == 1 else "")
        )
    if dp > 1 and not enable_dp_attention:
        raise ConfigError(
            f"--dp={dp} needs --enable-dp-attention (data parallelism lives inside "
            f"--tp={tp}); add --enable-dp-attention or set --dp=1"
        )
    if tp % dp:
        raise ConfigError(f"--dp={dp} does not divide --tp={tp}; choose dp in {_divisors(tp)}")
    moe_tp, attn_tp = tp // ep, tp // dp
    return ParallelLayout(
        world_size=world_size,
        tp=tp,
        pp=pp,
        ep=ep,
        dp=dp,
        moe_tp=moe_tp,
        attn_tp=attn_tp,
        enable_dp_attention=enable_dp_attention,
        pure_ep=False,
        tp_groups=_runs(tp, pp, tp),
        pp_groups=[list(range(j, world_size, tp)) for j in range(tp)],
        ep_groups=_strided(tp, pp, moe_tp),
        moe_tp_groups=_runs(tp, pp, moe_tp),
        attn_tp_groups=_runs(tp, pp, attn_tp),
        attn_dp_groups=_strided(tp, pp, attn_tp),
    )


def _pure_ep_layout(world_size: int, ep: int, dp: int) -> ParallelLayout:
    if world_size != ep:
        raise ConfigError(
            f"world_size={world_size} but pure expert parallelism (--tp=1 --pp=1 --ep={ep}) "
            f"runs one rank per EP rank; launch {ep} ranks or set --ep={world_size}"
        )
    if dp not in (1, ep):
        raise ConfigError(
            f"--dp={dp} with pure expert parallelism --ep={ep}: every rank is its own "
            f"attention-DP rank; set --dp=1 or --dp={ep}"
        )
    alone = [[r] for r in range(ep)]
    everyone = [list(range(ep))]
    return ParallelLayout(
        world_size=world_size,
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
