"""What the scheduler counts per rank: KV cache slots and KV pages."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.kv_budget import pages_for


class PageBudget:
    """One rank's KV pages as admission counts them: each running request holds the pages
    its longest run needs; the rank takes them as the sequence grows and gives a finished
    sequence's back when the next step names its slot in ``released``."""

    def __init__(self, total: int, page_size: int):
        self.total, self.page_size = total, page_size
        self.free = total
        self.released: list[int] = []

    def fits(self, pages: int) -> bool:
        return pages <= self.free

    def hold(self, pages: int) -> None:
        self.free -= pages

    def give(self, slot: int, pages: int) -> None:
        self.free += pages
        self.released.append(slot)

    def take_released(self) -> list[int]:
        released, self.released = self.released, []
        return released


class SlotAllocator:
    """Hands out cache rows; the scheduler holds one per rank."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.free)

    def alloc(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV cache slot")
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)


@dataclass(eq=False)
class CachedPage:
    id: int  # names the page to the ranks
    key: tuple[int, tuple[int, ...]]  # the page before it (0: none) and its token ids
    refs: int = 0  # running requests whose table holds it
    listed: bool = True  # found by lookups (False once flushed while in use)
    entry: int | None = None  # hybrid models: the snapshot entry of the state after this page


class WindowPages:
    """One rank's sliding-window layers' pool as its KV cache holds it where the budget gives
    those layers their windows alone (prefix caching off): before each forward the rank
    returns a sequence's pages wholly below the window of its first query, then takes those it
    grows into, so after a forward of tokens ``[start, end)`` it holds ``pages_for(end)`` less
    ``(start - window + 1) // page_size``."""

    def __init__(self, window: int, total: int, page_size: int):
        self.window, self.total, self.page_size = window, total, page_size
        self.free = total
        self.held: dict[int, int] = {}  # slot -> its pages in the pool now

    def after(self, start: int, fed: int) -> int:
        """Pages a sequence holds after a forward feeding ``fed`` tokens from ``start``."""
        below = max(0, start - self.window + 1) // self.page_size
        return pages_for(start + fed, self.page_size) - below

    def growth(self, seqs: list[tuple[int, int, int]]) -> int:
        """More pages (fewer, when negative) a step of (slot, start, fed) sequences takes."""
        return sum(self.after(start, fed) - self.held.get(slot, 0) for slot, start, fed in seqs)

    def hold(self, seqs: list[tuple[int, int, int]]) -> None:
        self.free -= self.growth(seqs)
        for slot, start, fed in seqs:
            self.held[slot] = self.after(start, fed)

    def leave(self, slot: int) -> None:
        """``slot``'s sequence ended: its pages go back with its release."""
        self.free += self.held.pop(slot, 0)
