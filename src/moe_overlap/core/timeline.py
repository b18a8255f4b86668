"""A per-rank record of when each micro-batch computed and when each all-to-all was in flight.

Disabled by default and then costs one attribute check per stage. Spans use
``time.perf_counter()``; the benchmark turns them into a Chrome trace and a picture. Two tracks
hold zero-length marks rather than time: ``split`` (each micro-batch's rows as a scheme cut the
forward) and ``decision`` (auto's choice, or why a scheme ran without overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from moe_overlap.core.tracks import DECISION, SPLIT, micro_batch


@dataclass
class Span:
    track: str  # core/tracks.py
    name: str
    start: float
    end: float
    rows: int | None = None  # a ``split`` mark: the micro-batch's rows (tokens) this forward
    nbytes: int | None = None  # an all-to-all's: the bytes a modelled link charges it


class Timeline:
    def __init__(self) -> None:
        self.enabled = False
        self.spans: list[Span] = []  # list.append is thread-safe: DBO records from two threads
        self._later: list[tuple[str, str, Callable[[], tuple[float, float]]]] = []

    def add(
        self, track: str, name: str, start: float, end: float, nbytes: int | None = None
    ) -> None:
        if self.enabled:
            self.spans.append(Span(track, name, start, end, nbytes=nbytes))

    def mark_split(self, rows: list[int]) -> None:
        """How a scheme cut this forward: micro-batch i (``mb{i}``) got ``rows[i]`` rows."""
        if self.enabled:
            now = time.perf_counter()
            for i, n in enumerate(rows):
                self.spans.append(Span(SPLIT, f"{micro_batch(i)}: {n} rows", now, now, rows=n))

    def mark_decision(self, text: str) -> None:
        """Why the forward ran as it did (a scheme that fell back to no overlap says why)."""
        now = time.perf_counter()
        self.add(DECISION, text, now, now)

    @contextmanager
    def span(self, track: str, name: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(track, name, start, time.perf_counter()))

    def add_later(self, track: str, name: str, times: Callable[[], tuple[float, float]]) -> None:
        """A span whose (start, end) only ``times()`` knows once the forward ran (a CUDA
        event's elapsed time); called by ``take``."""
        if self.enabled:
            self._later.append((track, name, times))

    def take(self) -> list[Span]:
        spans, self.spans = self.spans, []
        later, self._later = self._later, []
        return spans + [Span(track, name, *times()) for track, name, times in later]


def split_rows(spans: list[Span]) -> list[int]:
    """The rows of each micro-batch in a recorded forward, as its scheme cut it ([] if none did)."""
    return [s.rows for s in spans if s.track == SPLIT and s.rows is not None]
