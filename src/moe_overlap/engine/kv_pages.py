"""What the scheduler counts per rank: KV cache slots and KV pages, and a cached page."""

from __future__ import annotations

from dataclasses import dataclass


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
    key: tuple[int, tuple[int, ...]]  # the page before it (0: none), its token ids (page_keys)
    refs: int = 0  # running requests whose table holds it
    listed: bool = True  # found by lookups (False once flushed while in use)
    entry: int | None = None  # hybrid models: the snapshot entry of the state after this page
    window: bool = True  # sliding-window layers: its page for them is kept (engine/window_pages)
    window_refs: int = 0  # running requests whose window holds that page
