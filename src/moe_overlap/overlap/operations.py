"""Run a model's operations: sequentially, or several micro-batches interleaved by stages.

An op is ``fn(ctx, **previous_outputs) -> dict | None``. ``YIELD`` markers cut an op list into
stages; an overlapped run (TBO) lets micro-batch i lag micro-batch i-1 by ``delta_stages``
stages and then runs one stage of each in turn, so that one micro-batch computes while
another's communication is in flight. DBO's baton threads (baton.py) cut at the same markers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Op = Callable[..., dict | None]


class Yield:
    """A yield point: here another micro-batch may run (every scheme's one marker)."""

    def __repr__(self) -> str:
        return "YIELD"


YIELD = Yield()


def split_stages(ops: Sequence[Op | Yield]) -> list[list[Op]]:
    stages: list[list[Op]] = [[]]
    for op in ops:
        if isinstance(op, Yield):
            stages.append([])
        else:
            stages[-1].append(op)
    return stages


class StageExecutor:
    """One micro-batch walking through its stages; each ``next()`` runs one stage."""

    def __init__(self, ctx: Any, ops: Sequence[Op | Yield], inputs: dict | None = None):
        self.ctx = ctx
        self.stages = split_stages(ops)
        self.output = inputs or {}
        self.done = 0

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def next(self) -> None:
        timeline = getattr(self.ctx, "timeline", None)
        if timeline is not None and timeline.enabled:
            with timeline.span(self.ctx.name, f"stage {self.done}"):
                self._run_stage()
        else:
            self._run_stage()
        self.done += 1

    def _run_stage(self) -> None:
        for op in self.stages[self.done]:
            self.output = op(self.ctx, **self.output) or {}


def execute_operations(ctx: Any, ops: Sequence[Op | Yield], inputs: dict | None = None) -> dict:
    """Run ``ops`` in order (yields ignored); each op's dict is the next op's keyword arguments."""
    executor = StageExecutor(ctx, ops, inputs)
    for _ in range(executor.num_stages):
        executor.next()
    return executor.output


def overlapped_schedule(
    num_micro_batches: int, num_stages: int, delta_stages: int
) -> list[tuple[int, int]]:
    """The order of ``(micro_batch, stage)`` runs: micro-batch i starts ``i * delta`` ticks late.

    With two micro-batches this is SGLang's order: A runs ``delta`` stages alone, then A and B
    alternate, then B finishes its last ``delta`` stages alone.
    """
    if num_micro_batches < 1 or delta_stages < 0:
        raise ValueError(
            f"need >= 1 micro-batch and delta_stages >= 0, got {num_micro_batches}, {delta_stages}"
        )
    order = []
    for tick in range(num_stages + (num_micro_batches - 1) * delta_stages):
        for mb in range(num_micro_batches):
            stage = tick - mb * delta_stages
            if 0 <= stage < num_stages:
                order.append((mb, stage))
    return order


def execute_overlapped(
    ctxs: Sequence[Any],
    ops: Sequence[Sequence[Op | Yield]],
    delta_stages: int,
    inputs: Sequence[dict] | None = None,
) -> list[dict]:
    """Run N >= 1 micro-batches, each with its own context and op list, interleaved by stage."""
    inputs = inputs or [{} for _ in ctxs]
    executors = [StageExecutor(c, o, i) for c, o, i in zip(ctxs, ops, inputs, strict=True)]
    counts = {e.num_stages for e in executors}
    if len(counts) != 1:
        raise ValueError(f"micro-batches have different stage counts {sorted(counts)}")
    for mb, _ in overlapped_schedule(len(executors), counts.pop(), delta_stages):
        executors[mb].next()
    return [e.output for e in executors]
