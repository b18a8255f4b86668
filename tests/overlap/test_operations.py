"""Executing op lists: the stage executor (TBO) gives the sequential result in the expected
order; the baton threads (DBO) run one micro-batch at a time and every receive exactly once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from moe_overlap.core.context import StrictState
from moe_overlap.overlap.baton import Baton, DboStall, DualBatchThreads
from moe_overlap.overlap.operations import (
    YIELD,
    Yield,
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


# ---- the baton protocol, with toy ops (no model, no processes) ----


def new_guard() -> SimpleNamespace:
    """Counts the threads inside model code; a second one inside is an overlap."""
    return SimpleNamespace(inside=0, overlaps=0)


def toy_ops(guard: SimpleNamespace, log: list, layers: int = 1, pause: float = 5e-4) -> list:
    def op(name: str):
        def run(ctx, **kw):
            guard.inside += 1
            guard.overlaps += guard.inside != 1
            log.append((ctx.index, name))
            ctx.last = name
            time.sleep(ctx.sleep.get(name, pause))  # gives up the GIL: a racer would show here
            guard.inside -= 1
            if name == ctx.fail_at:
                raise ValueError(f"boom in mb{ctx.index}")
            return {"x": list(ctx.tokens)} if name == "embed" else kw

        return run

    ops = [op("embed")]
    for i in range(layers):
        ops += [op(f"attn{i}"), op(f"dispatch_a{i}"), YIELD]
        ops += [op(f"experts{i}"), op(f"combine_a{i}"), YIELD]
        ops += [op(f"output{i}")]
    return ops + [op("logits")]


def toy_hooks(log: list, runs: dict):
    def make_hook(ctx):
        key = (ctx.index, ctx.last)  # the receive for what the yielding op just launched
        runs[key] = 0

        def hook(waiter: str):
            assert waiter == f"mb{1 - ctx.index}"  # the other micro-batch runs it
            runs[key] += 1
            log.append(("recv", *key, threading.current_thread().name))

        return hook

    return make_hook


def toy_ctx(index: int, tokens=(1, 2), fail_at=None, sleep=None):
    return SimpleNamespace(
        index=index, name=f"mb{index}", tokens=tokens, fail_at=fail_at, sleep=sleep or {}
    )


def test_baton_alternates_and_other_thread_runs_each_receive_once():
    guard, log, runs = new_guard(), [], {}
    threads = DualBatchThreads(timeout_s=5, name="toy")
    try:
        outs = threads.run(
            [toy_ctx(0, (1, 2)), toy_ctx(1, ())], toy_ops(guard, log), toy_hooks(log, runs)
        )
    finally:
        threads.close()
    # micro-batch 1 is empty, yet makes the same calls and yields
    assert outs == [{"x": [1, 2]}, {"x": []}]
    assert log == [
        (0, "embed"), (0, "attn0"), (0, "dispatch_a0"),
        (1, "embed"), (1, "attn0"), (1, "dispatch_a0"), ("recv", 0, "dispatch_a0", "toy-mb1"),
        (0, "experts0"), (0, "combine_a0"), ("recv", 1, "dispatch_a0", "toy-mb0"),
        (1, "experts0"), (1, "combine_a0"), ("recv", 0, "combine_a0", "toy-mb1"),
        (0, "output0"), (0, "logits"), ("recv", 1, "combine_a0", "toy-mb0"),
        (1, "output0"), (1, "logits"),
    ]  # fmt: skip
    assert guard.overlaps == 0
    assert runs == {(m, k): 1 for m in (0, 1) for k in ("dispatch_a0", "combine_a0")}


def test_one_thread_at_a_time_over_many_runs_on_the_same_threads():
    guard, log, runs = new_guard(), [], {}
    threads = DualBatchThreads(timeout_s=5)
    idents = set()
    ops = toy_ops(guard, log, layers=3, pause=2e-4)
    ops.insert(1, lambda ctx, **kw: idents.add(threading.get_ident()) or kw)
    try:
        for i in range(15):
            tokens = [(), (5,)] if i % 2 else [(1,), (2, 3)]
            ctxs = [toy_ctx(0, tokens[0]), toy_ctx(1, tokens[1])]
            assert threads.run(ctxs, ops, toy_hooks(log, runs)) == [{"x": list(t)} for t in tokens]
            assert set(runs.values()) == {1} and len(runs) == 12  # every receive, exactly once
            baton = threads.last_run.baton
            assert baton.hooks_registered == baton.hooks_run == 12 and baton.owner is None
    finally:
        threads.close()
    assert guard.overlaps == 0 and len(idents) == 2  # one persistent pair of threads
    # the guard is not vacuous: the same ops on two free-running threads overlap
    model_ops = [o for o in ops if not isinstance(o, Yield)]
    free = [threading.Thread(target=lambda i=i: [o(toy_ctx(i)) for o in model_ops]) for i in (0, 1)]
    for t in free:
        t.start()
    for t in free:
        t.join()
    assert guard.overlaps > 0


def test_model_code_out_of_turn_is_refused():
    baton = Baton(timeout_s=1)
    baton.check(0)
    with pytest.raises(
        AssertionError, match="micro-batch 1 entered model code while micro-batch 0"
    ):
        baton.check(1)


@pytest.mark.parametrize(("mb", "where"), [(1, "experts0"), (0, "attn0"), (0, "logits")])
def test_error_in_one_micro_batch_stops_both_and_reraises(mb, where):
    guard, log, runs = new_guard(), [], {}
    threads = DualBatchThreads(timeout_s=10)
    ctxs = [toy_ctx(0), toy_ctx(1)]
    ctxs[mb].fail_at = where
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"boom in mb{mb}"):
        threads.run(ctxs, toy_ops(guard, log), toy_hooks(log, runs))
    assert time.monotonic() - start < 2
    assert log[-1] == (mb, where)  # nothing ran after the failing op, on either thread
    ctxs[mb].fail_at = None  # and the same threads serve the next forward
    assert threads.run(ctxs, toy_ops(guard, log), toy_hooks(log, runs)) == [{"x": [1, 2]}] * 2
    threads.close()
    assert not any(t.is_alive() for t in threads._threads)
    with pytest.raises(RuntimeError, match="closed"):
        threads.run(ctxs, toy_ops(guard, log), toy_hooks(log, runs))


def test_stalled_micro_batch_is_named_and_nothing_hangs():
    guard, log, runs = new_guard(), [], {}
    threads = DualBatchThreads(timeout_s=0.3)
    ctxs = [toy_ctx(0, sleep={"experts0": 2.0}), toy_ctx(1)]
    start = time.monotonic()
    with pytest.raises(DboStall, match="micro-batch 1 waited 0.3 s .* micro-batch 0 stalled"):
        threads.run(ctxs, toy_ops(guard, log), toy_hooks(log, runs))
    assert time.monotonic() - start < 1.2  # long before the slow op returns
    with pytest.raises(DboStall, match="still stuck in an earlier forward"):
        threads.run([toy_ctx(0), toy_ctx(1)], toy_ops(guard, log), toy_hooks(log, runs))
    time.sleep(max(0.0, start + 2.2 - time.monotonic()))  # the slow op returns and stops
    assert threads.run([toy_ctx(0), toy_ctx(1)], toy_ops(guard, log), toy_hooks(log, runs))
    assert log.count((0, "output0")) == 1  # the stalled forward never went on
    threads.close()


def test_interpreter_exits_without_close():
    code = (
        "from types import SimpleNamespace as N\n"
        "from moe_overlap.overlap.baton import DualBatchThreads\n"
        "from moe_overlap.overlap.operations import YIELD\n"
        "t = DualBatchThreads(5)\n"
        "ops = [lambda c, **kw: kw, YIELD, lambda c, **kw: {'ok': 1}]\n"
        "print(t.run([N(name='mb0'), N(name='mb1')], ops, lambda c: (lambda w: None)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[{'ok': 1}, {'ok': 1}]"
