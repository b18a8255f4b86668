"""Which data-parallel group a new request joins: SGLang's ``--load-balance-method``.

Pure functions of each group's load. A group with no free KV slot is never chosen; when every
group is full the request waits in the shared queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.errors import ConfigError

LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "minimum_tokens")
DEFAULT_LOAD_BALANCE_METHOD = "round_robin"  # SGLang's default


@dataclass(frozen=True)
class GroupLoad:
    requests: int  # running on the group (prefilling or decoding)
    tokens: int  # tokens it still has to compute for them (prompt left, plus one each)
    free_slots: int


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
    compute. Ties go to the lowest index.
    """
    open_groups = [g for g, load in enumerate(loads) if load.free_slots > 0]
    if not open_groups:
        return None
    if method == "round_robin":
        n = len(loads)
        return min(open_groups, key=lambda g: (g - turn) % n)
    if method == "shortest_queue":
        return min(open_groups, key=lambda g: loads[g].requests)
    if method == "minimum_tokens":
        return min(open_groups, key=lambda g: loads[g].tokens)
    raise ConfigError(f"unknown load balance method {method!r}")
