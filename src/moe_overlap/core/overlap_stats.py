"""How much communication a recorded forward hid behind computation, read off its timeline.

A micro-batch computes while one of its spans (a stage, a DBO segment, an SBO block) is open and
it is not blocked on a receive; communication is in flight from an all-to-all's launch to its
completion. The hidden share is the part of the time communication is in flight during which
some micro-batch computes: 0-100% by construction, whatever the mode's own compute time is.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core import tracks
from moe_overlap.core.timeline import Span

Intervals = list[tuple[float, float]]  # sorted, disjoint


def union(intervals: Intervals) -> Intervals:
    merged: Intervals = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: Intervals, b: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Intervals, b: Intervals) -> Intervals:
    out = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


@dataclass(frozen=True)
class OverlapStats:
    compute_s: float  # some micro-batch computing (the mode's own compute time, as overlapped)
    comm_s: float  # some all-to-all in flight
    hidden_s: float  # both at once

    @property
    def hidden_share(self) -> float | None:
        return self.hidden_s / self.comm_s if self.comm_s > 0 else None


def overlap_stats(spans: list[Span]) -> OverlapStats:
    """Compute, communication and their overlap in one rank's recorded forward."""
    # blocked on a receive, or in a blocking attention-TP collective: not computing
    waits = union(
        [(s.start, s.end) for s in spans if tracks.is_wait(s.track) or s.track == tracks.TP_COMM]
    )
    busy = union([(s.start, s.end) for s in spans if tracks.is_micro_batch(s.track)])
    compute = subtract(busy, waits)
    comm = union([(s.start, s.end) for s in spans if s.track == tracks.COMM])
    return OverlapStats(length(compute), length(comm), length(intersect(comm, compute)))


def combined(per_rank: list[OverlapStats]) -> OverlapStats:
    """Every rank's seconds added up, so the hidden share weighs ranks by their communication."""
    return OverlapStats(
        sum(s.compute_s for s in per_rank),
        sum(s.comm_s for s in per_rank),
        sum(s.hidden_s for s in per_rank),
    )
