"""What names a cached KV page (``engine/prefix_cache.py``), and the requests that may use one.

A page's key is the id of the page before it and its own token ids, compared whole. With the
MTP drafter a page also carries the MTP layers' entries (``model/caches.py``), and the entry at
its last position embeds the token after the page (MTP row ``q`` is the target's hidden state
at ``q`` and token ``q + 1``), so the key holds that token too: a hit reads only MTP entries
computed from its own tokens (those before the last were, by the same rule), which is what it
would compute itself, and its MTP extend starts at the hit's end, as the target's forward does.
So a request with MTP drafts, greedy or sampled (whose seeded tokens follow the drafts' q),
gets the tokens it gets without the cache. The cost: a page is cached only once the token
after it is known, and one prefix followed by two different tokens is two pages.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_overlap.engine.kv_pages import CachedPage
from moe_overlap.engine.request import Request

PageKey = tuple[int, tuple[int, ...]]


def page_key(
    chain: list[CachedPage], run: Sequence[int], size: int, follows: int
) -> PageKey | None:
    """The key of the page after ``chain`` whose ``size`` tokens ``run`` starts with, and the
    ``follows`` (0 or 1) tokens after them; None where ``run`` is shorter (not yet known)."""
    n = size + follows
    return None if len(run) < n else (chain[-1].id if chain else 0, tuple(run[:n]))


def may_use(req: Request) -> bool:
    """Whether ``req``'s prefill may skip cached pages: not when it returns or scores every
    prompt position's logits (vLLM skips the cache for prompt logprobs too)."""
    return not (req.return_logits or req.params.prompt_logprobs is not None)


def token_ids(req: Request, start: int, stop: int) -> list[int]:
    """``req``'s token ids ``[start, stop)``, prompt then outputs."""
    n = req.prompt_len
    return req.prompt_ids[start:stop] + req.output_ids[max(0, start - n) : max(0, stop - n)]
