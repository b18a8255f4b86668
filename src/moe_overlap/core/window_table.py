"""The sliding-window layers' own block table and pool (GPT-OSS, MiMo), beside ``KVCache``'s.

A page holds every layer's entries, so a page the sliding layers no longer need is still the
full layers'; only a table of their own can give it back. Slot ``s``'s window page ``i`` is
its page ``i`` for those layers, or ``NULL_PAGE`` once wholly below the window of the first
query of a forward (``trim``). A sequence's own window pages go back to this pool then; a
cached page's window page belongs to the cache (``cache``), so trimming only drops the slot's
entry, and it goes back when the driver says: with its full page (``evict``), or alone
(``drop``), where the driver counts this pool and needs the page for another sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NULL_PAGE = 0


class WindowTable:
    """``total`` pages for ``num_slots`` rows of ``width`` pages; ``window`` tokens, pages of
    ``page_size``."""

    def __init__(self, num_slots: int, width: int, total: int, window: int, page_size: int, device):
        self.window, self.page_size, self.total = window, page_size, total
        self.table = torch.zeros(num_slots, width, dtype=torch.long, device=device)
        self.held: list[list[int]] = [[] for _ in range(num_slots)]  # NULL_PAGE where trimmed
        self.free = list(range(total, NULL_PAGE, -1))  # popped lowest first
        self.trimmed = [0] * num_slots  # a slot's window pages below this index are dropped
        self.cached: dict[int, int] = {}  # a cached page's id -> its window page, while kept

    @property
    def used(self) -> int:
        return self.total - len(self.free)

    def keep(self, start: int) -> int:
        """The first page the window of a query at position ``start`` reads."""
        return max(0, start - self.window + 1) // self.page_size

    def reserve(self, slot: int, need: int) -> list[int]:
        """Pages up to index ``need`` for ``slot``; returns those taken."""
        held = self.held[slot]
        new = [self.free.pop() for _ in range(need - len(held))]
        if new:
            self.table[slot, len(held) : need] = torch.tensor(new)
            held.extend(new)
        return new

    def trim(
        self, slots: Sequence[int], starts: Sequence[int], full: list[list[int]], cached: set[int]
    ) -> None:
        """Each slot's window pages wholly below the window of its query at ``starts[i]``
        leave its row: its own go back to the pool, a cached page's (``full[slot][i]`` in
        ``cached``) stays the cache's."""
        rows: list[int] = []
        cols: list[int] = []
        for slot, start in zip(slots, starts, strict=True):
            held, pages = self.held[slot], full[slot]
            stop = min(self.keep(start), len(held))
            for i in range(self.trimmed[slot], stop):
                if held[i] != NULL_PAGE:
                    if pages[i] not in cached:
                        self.free.append(held[i])
                    held[i] = NULL_PAGE
                    rows.append(slot)
                    cols.append(i)
            self.trimmed[slot] = max(self.trimmed[slot], stop)
        if rows:  # one write to the device's table, however many pages went
            self.table[torch.tensor(rows), torch.tensor(cols)] = NULL_PAGE

    def release(self, slot: int, full: list[int], cached: set[int]) -> None:
        """``slot`` ended: its own window pages go back (a cached page's stays the cache's)."""
        pairs = zip(full, self.held[slot], strict=False)
        own = [w for p, w in pairs if w != NULL_PAGE and p not in cached]
        self.free.extend(reversed(own))
        self.held[slot], self.trimmed[slot] = [], 0
        self.table[slot].fill_(NULL_PAGE)

    def cache(self, slot: int, index: int, page_id: int) -> None:
        """Page ``index`` of ``slot`` is cached as ``page_id``: its window page is the cache's,
        where the slot still holds it (one published below the window has none)."""
        page = self.held[slot][index]
        if page != NULL_PAGE:
            self.cached[page_id] = page

    def drop(self, page_id: int) -> None:
        """A cached page's window page goes back to the pool (its full page stays cached)."""
        page = self.cached.pop(page_id, None)
        if page is not None:
            self.free.append(page)

    def attach(self, slot: int, ids: list[int]) -> None:
        """A new sequence starts on cached pages ``ids``: it holds their window pages from the
        window of its first query, at the end of those pages (the driver ends a hit where they
        are kept)."""
        keep = self.keep(len(ids) * self.page_size)
        missing = [i for i in ids[keep:] if i not in self.cached]
        if missing:
            raise RuntimeError(f"cached pages {missing} attached to slot {slot} have no window")
        window = [NULL_PAGE] * keep + [self.cached[i] for i in ids[keep:]]
        self.held[slot], self.trimmed[slot] = window, keep
        if window:
            self.table[slot, : len(window)] = torch.tensor(window)
