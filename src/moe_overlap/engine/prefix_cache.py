"""Prefix caching, as vLLM's automatic prefix caching does it: full KV pages named by their
tokens and the page before them, shared by later requests whose tokens start the same way.

A page is cached once every one of its tokens is computed (a running sequence's too), so it is
never written again. A request admitted later takes the longest chain of cached pages its
tokens start with (leaving at least its last token to compute, whose logits it draws from),
holds a reference on each and prefills only the rest. A page no request holds stays cached,
and is evicted least recently used first when the pool needs pages. The key of a page is the
id of the page before it and its own token ids, compared whole, so two prefixes never share a
page by a hash collision (``engine/page_keys.py``; with the MTP drafter the token after the
page too, which its last MTP entry embeds). The ranks learn every change through
``core/step.py: PageOps``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

from moe_overlap.core.step import PageOps
from moe_overlap.engine.kv_pages import CachedPage, PageBudget
from moe_overlap.engine.page_keys import PageKey, page_key, token_ids
from moe_overlap.engine.prefix_states import PrefixStates
from moe_overlap.engine.request import Request
from moe_overlap.engine.window_pages import WindowPages


class PrefixCache:
    """One rank's cached pages, beside its ``PageBudget``: ``budget.free`` counts the pages
    no request holds and none is cached, ``idle`` the cached pages no request holds (freed by
    eviction). ``ops`` gathers the page changes its rank applies before the next step.
    ``states``: a hybrid model's snapshot entries (``engine/prefix_states.py``): a hit ends
    at a page after which the recurrent state was kept, and restores it. ``windows``: the
    sliding-window layers' pool where it is counted (``engine/window_pages.py``): a hit ends
    where the window before it is kept. ``follows``: an MTP drafter's (its key holds the token
    after a page)."""

    def __init__(
        self,
        budget: PageBudget,
        enabled: bool = True,
        states: PrefixStates | None = None,
        windows: WindowPages | None = None,
        follows: bool = False,
    ):
        self.budget, self.enabled, self.page_size = budget, enabled, budget.page_size
        self.states, self.windows, self.follows = states, windows, int(follows)
        self.closed: set[int] = set()  # slots that met another's copy of a page: no more cached
        self.pages: dict[PageKey, CachedPage] = {}
        self.idle: OrderedDict[int, CachedPage] = OrderedDict()  # least recently used first
        # the idle pages that keep a state, in the order they went idle or got one, so a state
        # is taken from one without walking the idle pages that keep none (stale rows: pages
        # whose state another took since are passed over when met)
        self.idle_kept: OrderedDict[int, CachedPage] = OrderedDict()
        self.next_id = 1
        self.ops = PageOps()
        self.queries = self.hits = 0  # prompt tokens looked up, and found (vLLM's counters)
        self.evictions = 0  # cached pages freed for room or by a flush

    @property
    def evictable(self) -> int:
        return len(self.idle)

    def lookup(self, tokens: Sequence[int], usable: bool) -> list[CachedPage]:
        """The cached pages ``tokens`` start with, leaving the last token uncached (none where
        the request may not use the cache: ``usable`` False)."""
        if not (self.enabled and usable):
            return []
        chain = self._walk(tokens, [], (len(tokens) - 1) // self.page_size)
        while True:  # the longest prefix both a kept state and a kept window allow
            n = len(chain)
            chain = chain if self.states is None else self.states.usable(chain)
            chain = chain if self.windows is None else self.windows.usable(chain)
            if len(chain) == n:
                return chain

    def _walk(self, tokens: Sequence[int], chain: list[CachedPage], pages: int) -> list[CachedPage]:
        """``chain`` and the cached pages after it that ``tokens`` go on with, up to ``pages``."""
        size, found = self.page_size, list(chain)
        for i in range(len(chain), pages):
            key = self._key(found, tokens[i * size : (i + 1) * size + self.follows])
            page = None if key is None else self.pages.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def _key(self, chain: list[CachedPage], run: Sequence[int]) -> PageKey | None:
        return page_key(chain, run, self.page_size, self.follows)

    def cached_tokens(self, req: Request, usable: bool) -> int:
        """The tokens of ``req`` a lookup would find here now (``usable``: ``may_use``)."""
        return len(self.lookup(token_ids(req, 0, req.total_len), usable)) * self.page_size

    def acquire(self, chain: list[CachedPage]) -> None:
        for page in chain:
            page.refs += 1
            self.idle.pop(page.id, None)
            self.idle_kept.pop(page.id, None)

    def drop(self, chain: list[CachedPage]) -> None:
        """A request lets go of ``chain``: its tail first, so the tail is evicted first."""
        for page in reversed(chain):
            page.refs -= 1
            if page.refs == 0:
                if page.listed:
                    self.idle[page.id] = page
                    if page.entry is not None:
                        self.idle_kept[page.id] = page
                else:  # flushed while in use: nothing can find it
                    self._evict(page)

    def admit(self, req: Request, chain: list[CachedPage]) -> None:
        """``req`` joins its slot on ``chain`` (acquired already)."""
        slot, start = req.slot, len(chain) * self.page_size
        self.closed.discard(slot)  # a slot a PD-mux wave's abort freed without ``leave``
        if self.windows is not None:
            self.windows.attach(slot, chain)
        if not req.preemptions:  # as vLLM: a victim finding its own pages again is no hit
            self.queries += req.total_len
            self.hits += start
        if chain:
            self.ops.attach.append((slot, [page.id for page in chain]))
        if self.states is None or not self.enabled:
            return
        if chain:
            assert chain[-1].entry is not None  # lookup ends a hybrid's hit at a kept state
            self.ops.restore.append((slot, chain[-1].entry, start))
        tokens = token_ids(req, 0, req.total_len)
        branch = len(self._walk(tokens, chain, (len(tokens) - 1) // self.page_size))
        size = self.page_size
        for b in self.states.boundaries(req.prompt_len, branch * size, start, len(tokens), size):
            entry = self._free_entry()
            if entry is None:
                return
            self.states.plan(slot, b, entry)
            self.ops.snapshot.append((slot, b, entry))

    def keep_decoded(self, seqs: list[tuple[int, int, int]]) -> None:
        """A hybrid model's decode step of (slot, start, fed) sequences: each keeps its state
        at a page boundary its tokens cross (``PageOps.snapshot``), for a later turn."""
        if self.states is None or not self.enabled:
            return
        for slot, start, fed in seqs:
            boundary = (start + fed) // self.page_size * self.page_size
            if boundary <= start:
                continue
            entry = self._free_entry()
            if entry is None:
                return
            self.states.plan(slot, boundary, entry)
            self.states.decoding.add((slot, boundary))
            self.ops.snapshot.append((slot, boundary, entry))

    def _free_entry(self) -> int | None:
        """A free snapshot entry, else the least recently used idle page's (its KV stays)."""
        assert self.states is not None
        entry = self.states.take()
        if entry is not None:
            return entry
        while self.idle_kept:
            page = self.idle_kept.popitem(last=False)[1]
            if page.entry is not None:
                entry, page.entry = page.entry, None
                return entry
        return None

    def leave(self, slot: int) -> None:
        """``slot``'s request ends or is preempted (before it drops its cached pages)."""
        self.unattach(slot)
        self.closed.discard(slot)
        if self.windows is not None:
            self.windows.leave(slot)

    def unattach(self, slot: int) -> None:
        """Drop a pending attach of ``slot``: its request leaves in the step that admitted it
        (preempted at once), and the step's ops are applied by kind, releases before attaches,
        so the rank would attach pages to a slot the driver has already freed."""
        self.ops.attach = [(s, ids) for s, ids in self.ops.attach if s != slot]
        if self.states is not None:  # and its snapshot plans: their entries are free again
            self.ops.restore = [op for op in self.ops.restore if op[0] != slot]
            self.ops.snapshot = [op for op in self.ops.snapshot if op[0] != slot]
            self.states.leave(slot)

    def make_room(self, pages: int) -> bool:
        """Whether ``pages`` more pages can be taken: free ones, else idle cached ones evicted
        least recently used first (none is evicted unless that makes enough room)."""
        short = pages - self.budget.free
        if short > len(self.idle):
            return False
        for _ in range(max(0, short)):
            self._evict(self.idle.popitem(last=False)[1])
        return True

    def publish_computed(self, req: Request) -> None:
        """``publish`` the pages of running ``req`` that its last step filled (a cheap look
        first: most steps of most requests fill none)."""
        filled = req.num_computed // self.page_size > len(req.cached)
        if self.enabled and (filled or self.states is not None):
            self.publish(req.slot, partial(token_ids, req), req.num_computed, req.cached)

    def publish(
        self,
        slot: int,
        tokens: Callable[[int, int], list[int]],
        computed: int,
        chain: list[CachedPage],
    ) -> None:
        """Cache the full pages of the first ``computed`` tokens past ``chain`` (the request's
        cached pages, extended in place), stopping at one cached already from another sequence.
        ``tokens(start, stop)``: the request's token ids in that range."""
        if not self.enabled:
            return
        size = self.page_size
        for index in range(len(chain), 0 if slot in self.closed else computed // size):
            key = self._key(chain, tokens(index * size, (index + 1) * size + self.follows))
            if key is None:  # the token after it is not known yet (or the tokens end)
                break
            if key in self.pages:  # the same tokens in another page: this one and the rest
                self.closed.add(slot)  # stay its own (its window may drop them meanwhile)
                break
            page = CachedPage(self.next_id, key, refs=1)
            self.next_id += 1
            self.pages[key] = page
            chain.append(page)
            self.ops.publish.append((slot, index, page.id))
            if self.windows is not None:
                self.windows.cached(slot, page, index)
        if self.states is not None:
            self._keep_states(slot, tokens, computed, chain)

    def _keep_states(
        self,
        slot: int,
        tokens: Callable[[int, int], list[int]],
        computed: int,
        chain: list[CachedPage],
    ) -> None:
        """The states ``slot`` kept at boundaries its ``computed`` tokens passed go with the
        cached page ending there (this request's, or the same tokens' in another's chain);
        an entry whose page has a state already, or is not cached, is free again."""
        assert self.states is not None
        reached = self.states.reached(slot, computed)
        ids = tokens(0, max((b for b, _ in reached), default=0) + self.follows)
        for boundary, entry in reached:
            index = boundary // self.page_size  # the page ending at the boundary, and those before
            pages = self._walk(ids, chain[:index], index)
            page = pages[-1] if len(pages) == index else None
            if page is not None and page.entry is None:
                page.entry = entry
                if page.id in self.idle:  # the same tokens in a chain no request holds
                    self.idle_kept[page.id] = page
            else:
                page = None
                self.states.free.append(entry)
            self.states.kept(slot, boundary, page)

    def flush(self) -> int:
        """Forget every cached page: idle ones are evicted now, ones in use when their last
        request ends. Returns the pages evicted now."""
        idle = list(self.idle.values())
        self.idle.clear()
        self.idle_kept.clear()
        for page in idle:
            self._evict(page)
        for page in self.pages.values():
            page.listed = False
        self.pages.clear()
        return len(idle)

    def take_ops(self) -> PageOps:
        ops, self.ops = self.ops, PageOps()
        ops.released = self.budget.take_released()
        if self.windows is not None:
            ops.unwindow, self.windows.dropped = self.windows.dropped, []
        return ops

    def _evict(self, page: CachedPage) -> None:
        self.idle_kept.pop(page.id, None)
        if self.pages.get(page.key) is page:
            del self.pages[page.key]
        if page.entry is not None and self.states is not None:
            self.states.free.append(page.entry)
            page.entry = None
        if self.windows is not None:
            self.windows.evicted(page)
        self.ops.evict.append(page.id)
        self.evictions += 1
        self.budget.free += 1
