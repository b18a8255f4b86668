"""A per-rank record of when each micro-batch computed and when each all-to-all was in flight.

Disabled by default and then costs one attribute check per stage. Spans use
``time.perf_counter()``; the benchmark turns them into a Chrome trace and a picture.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Span:
    track: str  # "mb0", "mb1", ... computing; "mb0 wait" blocked on an all-to-all; "comm"
    name: str
    start: float
    end: float


class Timeline:
    def __init__(self) -> None:
        self.enabled = False
        self.spans: list[Span] = []  # list.append is thread-safe: DBO records from two threads
        self._later: list[tuple[str, str, Callable[[], tuple[float, float]]]] = []

    def add(self, track: str, name: str, start: float, end: float) -> None:
        if self.enabled:
            self.spans.append(Span(track, name, start, end))

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
