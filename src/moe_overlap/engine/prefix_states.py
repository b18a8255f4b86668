"""Where a hybrid model keeps its recurrent state for prefix caching: the driver's side of
``core/state_snapshots.py``.

A linear-attention layer's state is per sequence, so a cached prefix is usable only up to a
page after which the state was kept. Keeping it after every page would cost a whole state
(tens of MiB per sequence on the Hub's Qwen3.5) per page of 16 tokens, so a request keeps it at
most at the few boundaries where a later request is likely to stop: the last full page of its
prompt (a request repeating or extending this prompt stops there; also the page before, which
an identical prompt stops at when its length is a whole number of pages), and the branch point,
the end of the pages it found cached past the last kept state (others already shared those
tokens: SGLang's branching-point caching). While it decodes, it keeps the state at the last
page boundary its tokens crossed (a later turn of the conversation extends its prompt and
output): one planned at each boundary a decode step crosses, the one before given back once it
is reached, so a decoding request holds at most two (SGLang's ping-pong track buffer of a mamba
state). The entries are a fixed pool budgeted in the KV
cache memory (``core/engine_config.py``); one freed by an evicted page is reused, and when none
is free the least recently used idle page gives up its state (its KV pages stay cached).
"""

from __future__ import annotations

from moe_overlap.engine.kv_pages import CachedPage


class PrefixStates:
    """One rank's snapshot entries: the free ones and, per slot, those planned but not yet
    reached by its sequence."""

    def __init__(self, num_entries: int):
        self.num_entries = num_entries
        self.free = list(range(num_entries - 1, -1, -1))  # popped lowest first
        self.pending: dict[int, list[tuple[int, int]]] = {}  # slot -> (boundary, entry)
        self.decoding: set[tuple[int, int]] = set()  # (slot, boundary) planned by a decode step
        self.last_decoded: dict[int, CachedPage] = {}  # slot -> its last decoded boundary's page

    @staticmethod
    def usable(chain: list[CachedPage]) -> list[CachedPage]:
        """``chain`` up to its last page with a kept state (a hit must restore one there)."""
        ends = [i + 1 for i, page in enumerate(chain) if page.entry is not None]
        return chain[: ends[-1]] if ends else []

    @staticmethod
    def boundaries(prompt: int, branch: int, start: int, end: int, size: int) -> list[int]:
        """Where a request computing tokens ``[start, end)`` of a ``prompt``-token prompt keeps
        its state: its prompt's last full page (and the one an identical prompt stops at) and
        ``branch``, the end of the pages found cached, each past ``start``."""
        wanted = {prompt // size * size, (prompt - 1) // size * size, branch}
        return sorted(b for b in wanted if start < b <= end)

    def plan(self, slot: int, boundary: int, entry: int) -> None:
        self.pending.setdefault(slot, []).append((boundary, entry))

    def reached(self, slot: int, computed: int) -> list[tuple[int, int]]:
        """The planned (boundary, entry) pairs of ``slot`` its first ``computed`` tokens passed,
        taken off the plan."""
        plans = self.pending.get(slot, [])
        done = [p for p in plans if p[0] <= computed]
        if done:
            self.pending[slot] = [p for p in plans if p[0] > computed]
        return done

    def kept(self, slot: int, boundary: int, page: CachedPage | None) -> None:
        """``slot``'s state after ``boundary`` tokens went to ``page`` (None: not kept, the
        page has one already): a decode step's replaces the one the slot kept at the decoded
        boundary before."""
        if (slot, boundary) not in self.decoding:
            return
        self.decoding.discard((slot, boundary))
        if page is None:
            return
        before = self.last_decoded.get(slot)
        if before is not None and before.entry is not None:
            self.free.append(before.entry)
            before.entry = None
        self.last_decoded[slot] = page

    def leave(self, slot: int) -> None:
        """``slot``'s request left: the entries it never reached are free again (its last
        decoded boundary's state stays with its page)."""
        for _, entry in self.pending.pop(slot, []):
            self.free.append(entry)
        self.decoding = {p for p in self.decoding if p[0] != slot}
        self.last_decoded.pop(slot, None)

    def take(self) -> int | None:
        return self.free.pop() if self.free else None
