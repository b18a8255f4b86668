"""A local search after the greedy placement. A move changes the loads of a few GPUs; it is taken
when the largest of their new loads is below the largest of their old ones, which lowers the
GPU loads sorted from the largest, so the search ends. Two moves: swap two replicas between
GPUs, or give one slot to another expert (one replica fewer of a replicated expert, one more of
another). On large placements (more than ``WIDE_SLOTS`` slots) only moves that touch the
heaviest GPU are tried, which keeps a layer to a fraction of a second."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

WIDE_SLOTS = 32
KICK_SLOTS = 9
_EPS = 1e-9
Move = tuple[float, float, int, int, int]  # old peak, new peak, slot, expert, swapped slot (-1)


def refine(placement: list[int], load: list[float], num_gpus: int, cap: int) -> list[int]:
    """``placement`` improved; never two replicas of one expert on a GPU, none past ``cap``."""
    slots = list(placement)
    per = len(slots) // num_gpus
    for _ in range(4 * len(slots)):
        count = Counter(slots)
        totals = [
            sum(load[e] / count[e] for e in slots[g * per : (g + 1) * per]) for g in range(num_gpus)
        ]
        heavy = max(range(num_gpus), key=lambda g: (totals[g], -g))
        gpus = range(num_gpus) if len(slots) <= WIDE_SLOTS else [heavy]
        search = _Search(slots, load, count, totals, per, cap)
        moves = [m for g in gpus for m in (*search.swaps(g), *search.reassignments(g))]
        if not moves:
            break
        _, _, slot, expert, other = min(moves, key=lambda m: (-m[0], m[1]))
        if other >= 0:
            slots[other] = slots[slot]
        slots[slot] = expert
    return slots


class _Search:
    def __init__(
        self,
        slots: list[int],
        load: list[float],
        count: Counter[int],
        totals: list[float],
        per: int,
        cap: int,
    ) -> None:
        self.slots, self.load, self.count, self.totals = slots, load, count, totals
        self.per, self.cap = per, cap
        self.held = [set(slots[g * per : (g + 1) * per]) for g in range(len(totals))]
        self.where: dict[int, list[int]] = {}
        for j, e in enumerate(slots):
            self.where.setdefault(e, []).append(j // per)

    def weight(self, expert: int, extra: int = 0) -> float:
        return self.load[expert] / (self.count[expert] + extra)

    def swaps(self, gpu: int) -> Iterator[Move]:
        """Each improving swap of a replica on ``gpu`` with one on another GPU."""
        per, totals = self.per, self.totals
        for i in range(gpu * per, (gpu + 1) * per):
            a = self.slots[i]
            for j, b in enumerate(self.slots):
                other = j // per
                if other == gpu or b in self.held[gpu] or a in self.held[other]:
                    continue
                delta = self.weight(b) - self.weight(a)
                old = max(totals[gpu], totals[other])
                new = max(totals[gpu] + delta, totals[other] - delta)
                if new < old - _EPS:
                    yield (old, new, i, b, j)

    def reassignments(self, gpu: int) -> Iterator[Move]:
        """Each improving change of a slot's expert that touches ``gpu``: a slot there, or a new
        replica of an expert there."""
        for j, old in enumerate(self.slots):
            if self.count[old] < 2:
                continue
            at = j // self.per
            for new in range(len(self.load)) if at == gpu else self.held[gpu]:
                if new in self.held[at] or self.count[new] >= self.cap:
                    continue
                before, after = self._peaks(j, new)
                if after < before - _EPS:
                    yield (before, after, j, new, -1)

    def _peaks(self, slot: int, new: int) -> tuple[float, float]:
        # the largest load among the GPUs the change touches, before and after
        old, per = self.slots[slot], self.per
        touched = {*self.where[old], *self.where.get(new, [])}
        after = {g: self.totals[g] for g in touched}
        for g in touched:
            if old in self.held[g]:
                after[g] += self.weight(old, -1) - self.weight(old)
            if new in self.held[g]:
                after[g] += self.weight(new, 1) - self.weight(new)
        after[slot // per] += self.weight(new, 1) - self.weight(old, -1)
        return max(self.totals[g] for g in touched), max(after.values())


def refine_with_kicks(
    placement: list[int], load: list[float], num_gpus: int, cap: int
) -> list[int]:
    """``refine``, then on placements of at most ``KICK_SLOTS`` slots each single change of a
    slot's expert followed by ``refine`` again, kept while one lowers the heaviest GPU (a
    change of replica counts often pays only after the replicas are repacked)."""
    best = refine(placement, load, num_gpus, cap)
    if len(best) > KICK_SLOTS:
        return best
    peak = _peak(best, load, num_gpus)
    improved = True
    while improved:
        improved = False
        for kicked in _kicks(best, num_gpus, cap, len(load)):
            tried = refine(kicked, load, num_gpus, cap)
            if (p := _peak(tried, load, num_gpus)) < peak - _EPS:
                best, peak, improved = tried, p, True
                break
    return best


def _kicks(slots: list[int], num_gpus: int, cap: int, num_experts: int) -> Iterator[list[int]]:
    per = len(slots) // num_gpus
    count = Counter(slots)
    for j, old in enumerate(slots):
        held = slots[j // per * per : (j // per + 1) * per]
        for new in range(num_experts):
            if count[old] >= 2 and new not in held and count[new] < cap:
                yield [*slots[:j], new, *slots[j + 1 :]]


def _peak(slots: list[int], load: list[float], num_gpus: int) -> float:
    per = len(slots) // num_gpus
    count = Counter(slots)
    return max(
        sum(load[e] / count[e] for e in slots[g * per : (g + 1) * per]) for g in range(num_gpus)
    )
