"""Which data-parallel group a new request joins: SGLang's ``--load-balance-method``.

Pure functions of each group's load. A group with no free KV slot is never chosen; when every
group is full the request waits in the shared queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens", "cache_aware")
DEFAULT_LOAD_BALANCE_METHOD = "round_robin"  # SGLang's default
# cache_aware balances by queue instead once the groups' running requests differ by more than
# this (the SGLang router's balance_abs_threshold)
CACHE_AWARE_SPREAD = 32


@dataclass(frozen=True)
class GroupLoad:
    requests: int  # running on the group (prefilling or decoding)
    tokens: int  # tokens it still has to compute for them (prompt left, plus one each)
    free_slots: int
    cached: int = 0  # cache_aware: the next request's prompt tokens this group has cached


def check_method(method: object) -> str:
    if method not in LOAD_BALANCE_METHODS:
        raise ConfigError(
            f"--load-balance-method={method!r} must be one of {', '.join(LOAD_BALANCE_METHODS)}"
        )
    return method


def choose_group(method: str, loads: list[GroupLoad], turn: int) -> int | None:
    """The group for the next request, or None if none has a free slot.

    ``round_robin``: the groups in turn, from ``turn`` (the caller's cursor), skipping full
    ones; ``shortest_queue``: fewest requests; ``minimum_tokens``: fewest tokens left to
    compute; ``cache_aware`` (the SGLang router's policy, by prefix affinity): the group with
    the most of the request's prompt cached, unless none has any or the groups' request
    counts differ by more than ``CACHE_AWARE_SPREAD``, then fewest requests. Ties go to the
    lowest index.
    """
    open_groups = [g for g, load in enumerate(loads) if load.free_slots > 0]
    if not open_groups:
        return None
    if method == "round_robin":
        n = len(loads)
        return min(open_groups, key=lambda g: (g - turn) % n)
    if method == "shortest_queue":
        return min(open_groups, key=lambda g: loads[g].requests)
    if method == "cache_aware":
        counts = [loads[g].requests for g in open_groups]
        best = max(open_groups, key=lambda g: (loads[g].cached, -loads[g].requests, -g))
        if loads[best].cached and max(counts) - min(counts) <= CACHE_AWARE_SPREAD:
            return best
        return min(open_groups, key=lambda g: loads[g].requests)
    if method == "minimum_tokens":
        return min(open_groups, key=lambda g: loads[g].tokens)
    raise ConfigError(f"unknown load balance method {method!r}")
