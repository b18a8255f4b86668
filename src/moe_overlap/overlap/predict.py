"""Predicted time of one forward under each overlap mode, and the choice among them (pure).

The inputs are every rank's work this step (from the one agreement collective) and a
``Calibration`` of this model on these ranks and this link. Ranks meet at every all-to-all, so
the slowest rank's compute sets the pace:

- ``C``: compute of the busiest rank: ``kappa`` seconds per FLOP of its batch (attention grows
  with the prefix) plus ``per_seq`` per sequence; ``F``: fixed cost of one micro-batch's pass
  through every op (Python, launches);
- ``M``: communication, ``2 x MoE layers`` all-to-alls of ``latency + bytes / rate`` each;
- ``none``: ``C + F + M``;
- ``sbo``: the dispatch hides behind the shared experts and all but the last combine piece
  behind the routed experts: ``C + F + M - hidden``;
- ``tbo<N>`` / ``dbo``: N micro-batches pipeline compute against communication:
  ``max(C + N F, M') + (C + M) / (N S)``, where ``M'`` adds each extra all-to-all's latency and
  the last term is the fill and drain of ``S = 2 x MoE layers`` stages.

Each mode's prediction is then scaled by its own factor, measured at calibration and corrected
online from measured forwards, which absorbs what the formulas leave out (bubbles, uneven cuts,
thread hand-offs). Only the executed mode's factor learns, so a mode measured slow once (at
calibration, say) would never be tried again: on a few set forwards (``explores``) the modes
predicted nearly as fast as the chosen one take turns instead (``explore``), and the
measured time corrects the explored mode's factor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from moe_overlap.core.mode_labels import auto_choice_config
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE, Runs

MARGIN = 0.03  # overlap must promise this much over none: a wrong guess must not cost more
EXPLORE_MARGIN = 0.15  # try a mode predicted at most this much slower than the chosen one
EXPLORE_FIRST = (2, 4, 8)  # soon after calibration, then every EXPLORE_EVERY-th forward
EARLY_MARGIN = 0.25  # the first tries look further: a calibration can be this far off
EXPLORE_EVERY = 16  # a wrong try costs at most EXPLORE_MARGIN / EXPLORE_EVERY on average
CORRECT_WEIGHT = 0.3  # how far one measured forward moves the executed mode's factor
EXPLORE_WEIGHT = 1.0  # an explored mode's factor is what its try measured


@dataclass
class Calibration:
    kappa: float  # seconds of compute per FLOP of a batch (core/model_flops.py: ModelFlops)
    per_seq: float  # seconds per sequence (per-sequence attention and cache work)
    per_pass: float  # seconds of fixed cost per micro-batch pass through every op
    latency: float  # seconds per all-to-all besides its bytes
    bytes_per_s: float  # the rate one rank's all-to-all sees
    bytes_per_token: float  # bytes one rank sends per token and all-to-all
    moe_layers: int
    expert_share: float  # of the per-token FLOPs: routed experts
    shared_share: float  # of the per-token FLOPs: shared experts
    sbo_blocks: int = 2
    factor: dict[str, float] = field(default_factory=lambda: dict.fromkeys(candidates(), 1.0))


@dataclass(frozen=True)
class StepStats:
    """This step on every rank, as the agreement collective sees it."""

    flops: list[float]  # per rank: estimated FLOPs of its batch (0: idle)
    tokens: list[int]
    seqs: list[int]
    tbo_ok: bool  # every rank can split, and the busy ranks' forward modes allow TBO
    dbo_split: int | None  # DBO's agreed cut (vLLM's rule), None if it must not run


@dataclass(frozen=True)
class Choice:
    mode: str
    predicted: dict[str, float]  # seconds, factors applied, feasible modes only
    explored: bool = False  # run to measure it, not because it was predicted fastest

    def describe(self) -> str:
        times = ", ".join(f"{m} {t * 1e3:.0f}" for m, t in self.predicted.items())
        why = "exploring; " if self.explored else ""
        return f"{self.mode} ({why}predicted ms: {times})"


def candidates() -> list[str]:
    """What auto may choose (``core/overlap_modes.py``), in order: ties go to the earlier,
    simpler one."""
    return list(MODES.auto_choices())


@functools.cache
def shape(label: str) -> tuple[Runs, int]:
    """How the choice ``label`` runs, and its micro-batches per forward."""
    cfg = auto_choice_config(OverlapConfig(), label)
    mode = MODES[cfg.mode]
    return mode.runs, cfg.num_micro_batches if mode.runs is Runs.SPLIT else mode.micro_batches


def feasible(stats: StepStats, ep: int) -> list[str]:
    idle = ep < 2 or max(stats.tokens) == 0  # nothing to hide
    busy = [t for t in stats.tokens if t]
    fits = {
        Runs.PLAIN: lambda n: True,
        Runs.BLOCKS: lambda n: not idle,
        Runs.SPLIT: lambda n: not idle and stats.tbo_ok and min(busy) >= n,
        Runs.THREADS: lambda n: not idle and stats.dbo_split is not None,
    }
    return [m for m in candidates() if _fits(fits, m)]


def _fits(fits: dict, label: str) -> bool:
    runs, n = shape(label)
    return fits[runs](n)


def raw_times(cal: Calibration, stats: StepStats) -> dict[str, float]:
    """Each candidate's predicted seconds before its factor."""
    compute = max(
        cal.kappa * f + cal.per_seq * s for f, s in zip(stats.flops, stats.seqs, strict=True)
    )
    a2a = 2 * cal.moe_layers
    comm = a2a * (cal.latency + max(stats.tokens) * cal.bytes_per_token / cal.bytes_per_s)
    blocks = cal.sbo_blocks
    hidden = min(comm / 2, cal.shared_share * compute) + min(
        comm / 2 * (blocks - 1) / blocks, cal.expert_share * compute * (blocks - 1) / blocks
    )
    times = {}
    for mode in candidates():
        runs, n = shape(mode)
        if runs is Runs.PLAIN:
            times[mode] = compute + cal.per_pass + comm
        elif runs is Runs.BLOCKS:
            times[mode] = compute + cal.per_pass + comm - hidden
        else:  # micro-batches: each pays a pass, a further latency per all-to-all, and the fill
            comm_n = comm + (n - 1) * a2a * cal.latency
            fill = (compute + comm) / (n * a2a)
            times[mode] = max(compute + n * cal.per_pass, comm_n) + fill
    return times


def choose(
    cal: Calibration, stats: StepStats, ep: int, allowed: tuple[str, ...] | None = None
) -> Choice:
    """Among the ``allowed`` modes that fit this step, the least predicted time; overlap only
    if it beats none by ``MARGIN`` (when none is allowed); none if no allowed mode fits."""
    raw = raw_times(cal, stats)
    modes = [m for m in feasible(stats, ep) if allowed is None or m in allowed]
    predicted = {m: raw[m] * cal.factor.get(m, 1.0) for m in modes}
    if not predicted:
        return Choice(NONE.name, {})
    order = candidates()
    best = min(predicted, key=lambda m: (predicted[m], order.index(m)))
    if NONE.name in predicted and predicted[best] > predicted[NONE.name] * (1 - MARGIN):
        best = NONE.name
    return Choice(best, predicted)


def explorations(forward: int) -> int:
    """How many of forwards 1 .. ``forward`` (counted from auto's first) explore."""
    return sum(f <= forward for f in EXPLORE_FIRST) + forward // EXPLORE_EVERY


def explore(choice: Choice, forward: int) -> Choice:
    """What forward number ``forward`` runs: ``choice``, except on an exploring forward (one
    of ``EXPLORE_FIRST`` or a multiple of ``EXPLORE_EVERY``), where the other modes predicted
    within ``EARLY_MARGIN`` (the first tries) or ``EXPLORE_MARGIN`` of the chosen one take
    turns, nearest first. A pure function of values every rank holds alike, so every rank
    explores the same mode with no collective."""
    if forward in EXPLORE_FIRST:
        margin = EARLY_MARGIN
    elif forward > 0 and forward % EXPLORE_EVERY == 0:
        margin = EXPLORE_MARGIN
    else:
        return choice
    best = choice.predicted.get(choice.mode)
    if best is None:
        return choice
    order = candidates()
    near = sorted(
        (m for m, t in choice.predicted.items() if m != choice.mode and t <= best * (1 + margin)),
        key=lambda m: (choice.predicted[m], order.index(m)),
    )
    if not near:
        return choice
    turn = near[(explorations(forward) - 1) % len(near)]
    return Choice(turn, choice.predicted, explored=True)


def corrected(
    cal: Calibration,
    mode: str,
    predicted_raw: float,
    measured: float,
    *,
    weight: float = CORRECT_WEIGHT,
) -> None:
    """Move ``mode``'s factor ``weight`` of the way towards what a measured forward showed
    (every rank alike)."""
    if predicted_raw <= 0 or measured <= 0:
        return
    ratio = min(max(measured / predicted_raw, 0.25), 4.0)
    cal.factor[mode] = (1 - weight) * cal.factor.get(mode, 1.0) + weight * ratio
