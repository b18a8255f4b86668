"""Prefix caching, as vLLM's automatic prefix caching does it: full KV pages named by their
tokens and the page before them, shared by later requests whose tokens start the same way.

A page is cached once every one of its tokens is computed (a running sequence's too), so it is
never written again. A request admitted later takes the longest chain of cached pages its
tokens start with (leaving at least its last token to compute, whose logits it draws from),
holds a reference on each and prefills only the rest. A page no request holds stays cached,
and is evicted least recently used first when the pool needs pages. The key of a page is the
id of the page before it and its own token ids, compared whole, so two prefixes never share a
page by a hash collision. The ranks learn every change through ``core/step.py: PageOps``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.step import PageOps
from moe_overlap.engine.kv_pages import CachedPage, PageBudget
from moe_overlap.engine.request import Request

log = logging.getLogger(__name__)


def may_use(req: Request) -> bool:
    """Whether ``req``'s prefill may skip cached pages: not when it returns or scores every
    prompt position's logits (vLLM skips the cache for prompt logprobs too)."""
    return not (req.return_logits or req.params.prompt_logprobs is not None)


def token_ids(req: Request, start: int, stop: int) -> list[int]:
    """``req``'s token ids ``[start, stop)``, prompt then outputs."""
    n = req.prompt_len
    return req.prompt_ids[start:stop] + req.output_ids[max(0, start - n) : max(0, stop - n)]


def refusal(cfg: ModelConfig, pdmux: bool) -> str | None:
    """Why prefix caching cannot serve this model or engine exactly, or None."""
    if cfg.is_hybrid:
        return (
            "its linear-attention layers keep a per-sequence recurrent state, not per-token "
            "pages, and the state at a page boundary is not kept"
        )
    if pdmux:
        return "PD multiplexing prefills each prompt whole, in layer ranges, from position 0"
    return None


def prefix_caching(asked: bool, cfg: ModelConfig, pdmux: bool) -> bool:
    """Whether the engine caches prefixes: ``asked`` (``--enable-prefix-caching``) unless
    ``refusal`` says why not, which is logged."""
    reason = refusal(cfg, pdmux) if asked else None
    if reason is not None:
        log.info("prefix caching is off: %s", reason)
    return asked and reason is None


class PrefixCache:
    """One rank's cached pages, beside its ``PageBudget``: ``budget.free`` counts the pages
    no request holds and none is cached, ``idle`` the cached pages no request holds (freed by
    eviction). ``ops`` gathers the page changes its rank applies before the next step."""

    def __init__(self, budget: PageBudget, enabled: bool = True):
        self.budget, self.enabled, self.page_size = budget, enabled, budget.page_size
        self.pages: dict[tuple[int, tuple[int, ...]], CachedPage] = {}
        self.idle: OrderedDict[int, CachedPage] = OrderedDict()  # least recently used first
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
        chain: list[CachedPage] = []
        if not (self.enabled and usable):
            return chain
        size, parent = self.page_size, 0
        for i in range((len(tokens) - 1) // size):
            page = self.pages.get((parent, tuple(tokens[i * size : (i + 1) * size])))
            if page is None:
                break
            chain.append(page)
            parent = page.id
        return chain

    def cached_tokens(self, req: Request) -> int:
        """The tokens of ``req`` a lookup would find here now."""
        return len(self.lookup(token_ids(req, 0, req.total_len), may_use(req))) * self.page_size

    def acquire(self, chain: list[CachedPage]) -> None:
        for page in chain:
            page.refs += 1
            self.idle.pop(page.id, None)

    def drop(self, chain: list[CachedPage]) -> None:
        """A request lets go of ``chain``: its tail first, so the tail is evicted first."""
        for page in reversed(chain):
            page.refs -= 1
            if page.refs == 0:
                if page.listed:
                    self.idle[page.id] = page
                else:  # flushed while in use: nothing can find it
                    self._evict(page)

    def admit(self, slot: int, chain: list[CachedPage], tokens: int) -> None:
        """A request of ``tokens`` tokens joins ``slot`` on ``chain`` (acquired already)."""
        self.queries += tokens
        self.hits += len(chain) * self.page_size
        if chain:
            self.ops.attach.append((slot, [page.id for page in chain]))

    def unattach(self, slot: int) -> None:
        """Drop a pending attach of ``slot``: its request leaves in the step that admitted it
        (preempted at once), and the step's ops are applied by kind, releases before attaches,
        so the rank would attach pages to a slot the driver has already freed."""
        self.ops.attach = [(s, ids) for s, ids in self.ops.attach if s != slot]

    def make_room(self, pages: int) -> bool:
        """Whether ``pages`` more pages can be taken: free ones, else idle cached ones evicted
        least recently used first (none is evicted unless that makes enough room)."""
        short = pages - self.budget.free
        if short > len(self.idle):
            return False
        for _ in range(max(0, short)):
            self._evict(self.idle.popitem(last=False)[1])
        return True

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
        for index in range(len(chain), computed // size):
            key = (chain[-1].id if chain else 0, tuple(tokens(index * size, (index + 1) * size)))
            if key in self.pages:
                return  # the same tokens in another page: this one stays the request's own
            page = CachedPage(self.next_id, key, refs=1)
            self.next_id += 1
            self.pages[key] = page
            chain.append(page)
            self.ops.publish.append((slot, index, page.id))

    def flush(self) -> int:
        """Forget every cached page: idle ones are evicted now, ones in use when their last
        request ends. Returns the pages evicted now."""
        idle = list(self.idle.values())
        self.idle.clear()
        for page in idle:
            self._evict(page)
        for page in self.pages.values():
            page.listed = False
        self.pages.clear()
        return len(idle)

    def take_ops(self) -> PageOps:
        ops, self.ops = self.ops, PageOps()
        ops.released = self.budget.take_released()
        return ops

    def _evict(self, page: CachedPage) -> None:
        if self.pages.get(page.key) is page:
            del self.pages[page.key]
        self.ops.evict.append(page.id)
        self.evictions += 1
        self.budget.free += 1
