"""Time how a hybrid model's prefix cache finds a state entry once none is free: a pool of
20,000 idle cached pages, one in 50 keeping a state, and 50 decode steps that each take 8
(8 sequences crossing a page boundary). Run it on two commits to compare.

    PYTHONPATH=src python scripts/state_entry_bench.py
"""

from __future__ import annotations

import time

from moe_overlap.engine.kv_pages import CachedPage, PageBudget
from moe_overlap.engine.prefix_cache import PrefixCache
from moe_overlap.engine.prefix_states import PrefixStates

PAGES, EVERY, STEPS, TAKES = 20_000, 50, 50, 8


def idle_pool() -> PrefixCache:
    states = PrefixStates(PAGES // EVERY)
    cache = PrefixCache(PageBudget(PAGES, 16), True, states)
    chain = []
    for i in range(PAGES):
        entry = states.take() if i % EVERY == EVERY - 1 else None
        page = CachedPage(i + 1, (i, (i,)), refs=1, entry=entry)
        cache.pages[page.key] = page
        chain.append(page)
    cache.drop(chain[::-1])  # all idle, the first page the least recently used
    return cache


def main() -> None:
    cache = idle_pool()
    start = time.perf_counter()
    for _ in range(STEPS * TAKES):
        assert cache._free_entry() is not None
    per_step = (time.perf_counter() - start) / STEPS
    print(f"{PAGES} idle pages, 1 in {EVERY} with a state: {per_step * 1e6:.1f} us per step "
          f"of {TAKES} takes")  # fmt: skip


if __name__ == "__main__":
    main()
