"""Run a model's operations: sequentially, or several micro-batches interleaved by stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Op = Callable[..., dict | None]


def execute_operations(ctx: Any, ops: Sequence[Op], inputs: dict | None = None) -> dict:
    """Run ``ops`` in order; each op's returned dict becomes the next op's keyword arguments."""
    out = inputs or {}
    for op in ops:
        out = op(ctx, **out) or {}
    return out
