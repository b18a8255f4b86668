"""The stage executor: N micro-batches give the sequential result, in the expected order."""

from __future__ import annotations

import pytest

from moe_overlap.core.context import StrictState
from moe_overlap.overlap.operations import (
    YIELD,
    execute_operations,
    execute_overlapped,
    overlapped_schedule,
)


class Ctx:
    def __init__(self, name, log):
        self.name, self.log, self.state = name, log, StrictState()


def make_ops(num_stages):
    """A toy op list: each stage adds its index and logs (micro-batch, stage)."""

    def step(stage):
        def op(ctx, x):
            ctx.log.append((ctx.name, stage))
            return {"x": x * 3 + stage}

        return op

    ops = []
    for s in range(num_stages):
        ops += [step(s), YIELD] if s < num_stages - 1 else [step(s)]
    return ops


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("delta", [0, 1, 2])
def test_overlapped_equals_sequential(n, delta):
    ops = make_ops(4)
    log = []
    expected = [execute_operations(Ctx(i, []), ops, {"x": i}) for i in range(n)]
    got = execute_overlapped(
        [Ctx(i, log) for i in range(n)], [ops] * n, delta, [{"x": i} for i in range(n)]
    )
    assert got == expected
    assert log == overlapped_schedule(n, 4, delta)
    for i in range(n):  # each micro-batch runs its own stages in order
        assert [s for m, s in log if m == i] == list(range(4))


def test_schedule_matches_sglang_for_two():
    # A runs delta stages alone, then A and B alternate, then B finishes alone
    assert overlapped_schedule(2, 3, 0) == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert overlapped_schedule(2, 4, 2) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (0, 3),
        (1, 1),
        (1, 2),
        (1, 3),
    ]


def test_three_micro_batches_with_lag_one():
    assert overlapped_schedule(3, 2, 1) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_mismatched_stage_counts_are_refused():
    with pytest.raises(ValueError, match="different stage counts"):
        execute_overlapped(
            [Ctx(0, []), Ctx(1, [])], [make_ops(2), make_ops(3)], 0, [{"x": 0}, {"x": 0}]
        )


def test_strict_state_refuses_overwrite_and_reports_leaks():
    state = StrictState()
    state.put(a=1)
    with pytest.raises(KeyError, match="already holds 'a'"):
        state.put(a=2)
    with pytest.raises(AssertionError, match=r"leaks \['a'\] past layer 3"):
        state.assert_empty("layer 3")
    assert state.pop("a") == 1
    with pytest.raises(KeyError, match="has no 'a'"):
        state.pop("a")
    state.assert_empty("layer 3")
