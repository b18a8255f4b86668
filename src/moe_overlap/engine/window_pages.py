"""One rank's sliding-window layers' pool as the driver counts it, where the budget gives those
layers their windows alone (``core/engine_config.py: _pages``), prefix caching on or off.

Before each forward the rank drops a sequence's window pages wholly below the window of its
first query (``core/window_table.py``), then takes those it grows into: after a forward of
tokens ``[start, end)`` its row holds pages ``[keep(start), pages_for(end))``. Those past its
cached pages are its own, counted per sequence. A cached page's window page is the cache's,
counted once however many sequences hold it, and kept while some sequence's window holds it;
once none does it is idle, still kept for a later request that stops there, until the pool
needs the page for a growing sequence: then idle ones go back, least recently idle first
(``PageOps.unwindow``), and a hit ends only where the window before it is still kept
(``usable``), as vLLM frees a sliding-window block outside the window but finds it cached
until it is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from moe_overlap.core.kv_budget import pages_for
from moe_overlap.engine.kv_pages import CachedPage


@dataclass
class Row:
    """One running sequence's window: ``cached`` is its request's chain of cached pages (the
    same list, extended in place as its pages are cached), ``below`` the pages it dropped,
    ``end`` the pages its last forward reached."""

    cached: list[CachedPage]
    below: int
    end: int

    @property
    def own(self) -> int:
        return max(0, self.end - max(self.below, len(self.cached)))


class WindowPages:
    """``total`` pages of ``page_size`` for windows of ``window`` tokens; ``free`` is what the
    rank's pool has free after the last step's forward."""

    def __init__(self, window: int, total: int, page_size: int):
        self.window, self.total, self.page_size = window, total, page_size
        self.free = total
        self.rows: dict[int, Row] = {}  # slot -> its window
        self.idle: OrderedDict[int, CachedPage] = OrderedDict()  # least recently idle first
        self.dropped: list[int] = []  # cached pages whose window page went back, for the rank
        self.given_back = 0  # cached pages' window pages given back for room, all told

    def keep(self, start: int) -> int:
        """The first page the window of a query at position ``start`` reads."""
        return max(0, start - self.window + 1) // self.page_size

    def usable(self, chain: list[CachedPage]) -> list[CachedPage]:
        """``chain`` up to its last page whose window (the pages the window of a query right
        after it reads) is kept whole."""
        n = len(chain)
        while n and not all(p.window for p in chain[self.keep(n * self.page_size) : n]):
            n -= 1
        return chain[:n]

    def attach(self, slot: int, chain: list[CachedPage]) -> None:
        """``slot``'s request starts on ``chain`` (its cached pages): it holds their window
        pages from the window of its first query."""
        below = self.keep(len(chain) * self.page_size)
        for page in chain[below:]:
            page.window_refs += 1
            self.idle.pop(page.id, None)
        self.rows[slot] = Row(chain, below, len(chain))

    def cached(self, slot: int, page: CachedPage, index: int) -> None:
        """Page ``index`` of ``slot`` was cached as ``page`` (appended to its chain): its window
        page moves from the sequence to the cache, or it has none, below the window."""
        if index >= self.rows[slot].below:
            page.window_refs = 1
        else:
            page.window = False

    def take(self, seqs: list[tuple[int, int, int]]) -> bool:
        """Hold the pages a step of (slot, start, fed) sequences grows into after each drops
        those below its window, giving idle cached ones back where too few are free; False
        (and nothing taken or given back) where even that is too few."""
        for slot, start, _ in seqs:
            self._trim(slot, self.keep(start))
        ends = [pages_for(start + fed, self.page_size) for _, start, fed in seqs]
        rows = [self.rows[slot] for slot, _, _ in seqs]
        pairs = zip(rows, ends, strict=True)
        grow = sum(max(0, e - max(r.below, len(r.cached))) - r.own for r, e in pairs)
        short = grow - self.free
        if short > len(self.idle):
            return False
        for _ in range(max(0, short)):
            page = self.idle.popitem(last=False)[1]
            page.window = False
            self.dropped.append(page.id)
            self.free += 1
            self.given_back += 1
        for row, end in zip(rows, ends, strict=True):
            row.end = end
        self.free -= grow
        return True

    def _trim(self, slot: int, below: int) -> None:
        row = self.rows[slot]
        if below <= row.below:
            return
        own = row.own
        for page in row.cached[row.below : below]:
            self._let_go(page)
        row.below = below
        self.free += own - row.own

    def leave(self, slot: int) -> None:
        """``slot``'s sequence ended (before its request drops its cached pages)."""
        row = self.rows.pop(slot, None)
        if row is None:
            return
        self.free += row.own
        for page in row.cached[row.below :]:
            self._let_go(page)

    def _let_go(self, page: CachedPage) -> None:
        page.window_refs -= 1
        if page.window_refs == 0 and page.window:
            self.idle[page.id] = page

    def evicted(self, page: CachedPage) -> None:
        """``page`` left the cache (no request holds it): its window page goes with it."""
        if page.window:
            page.window = False
            self.idle.pop(page.id, None)
            self.free += 1
