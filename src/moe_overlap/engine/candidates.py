"""``n`` and ``best_of`` (vLLM's meanings): a prompt asks for ``best_of`` candidates (``n`` when
unset), each an ordinary request with its own seed, and gets back the ``n`` whose generated
tokens have the highest total log-probability (all of them, in order, when ``best_of`` is
``n``)."""

from __future__ import annotations

import dataclasses

from moe_overlap.core.errors import is_int
from moe_overlap.engine.request import InvalidRequestError, SamplingParams

MAX_CANDIDATES = 64  # per prompt: each is a request of its own


def check_candidates(params: SamplingParams) -> int:
    """How many requests the prompt becomes; refuses a bad ``n``/``best_of`` by name."""
    n, best_of = params.n, params.best_of
    if not is_int(n) or n < 1:
        raise InvalidRequestError(f"n={n!r} must be an integer >= 1", "n")
    if best_of is None:
        best_of = n
    if not is_int(best_of) or best_of < n:
        raise InvalidRequestError(f"best_of={best_of!r} must be an integer >= n={n}", "best_of")
    if best_of > MAX_CANDIDATES:
        message = f"best_of={best_of} (or n) must be at most {MAX_CANDIDATES}"
        raise InvalidRequestError(message, "best_of")
    return best_of


def candidates(params: SamplingParams) -> list[SamplingParams]:
    """One request's parameters per candidate: seeds ``seed``, ``seed + 1``, ... when seeded
    (a seeded request is reproducible), and log-probabilities asked when ``best_of`` must rank
    them."""
    count = check_candidates(params)
    if count == 1:
        return [params]
    ranks = count > params.n
    return [
        dataclasses.replace(
            params,
            n=1,
            best_of=None,
            seed=None if params.seed is None else params.seed + k,
            logprobs=params.logprobs if params.logprobs is not None or not ranks else 0,
        )
        for k in range(count)
    ]


def chosen(params: SamplingParams, scores: list[float | None]) -> list[int]:
    """Which candidates a prompt returns, in order: the ``n`` best by total log-probability
    when there are more, else every one."""
    order = list(range(len(scores)))
    if len(scores) > params.n:
        order.sort(key=lambda k: -(scores[k] or 0.0))
    return order[: params.n]
