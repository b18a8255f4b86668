"""Dual batch overlap: the baton protocol, the cross-rank decision, and exactness at ep=2."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher, InFlight
from moe_overlap.distributed.groups import CommHandle, Group
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.agreement import (
    dbo_decide,
    dbo_gather_table,
    dbo_local_column,
    dbo_vote,
)
from moe_overlap.overlap.baton import Baton, DboStall, DboYield, DualBatchThreads
from moe_overlap.runtime.model_runner import ModelRunner
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same

DBO = OverlapConfig("dbo", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)

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
            time.sleep(ctx.sleep.get(name, pause))  # gives up the GIL: a racer would show here
            guard.inside -= 1
            if name == ctx.fail_at:
                raise ValueError(f"boom in mb{ctx.index}")
            return {"x": list(ctx.tokens)} if name == "embed" else kw

        return run

    ops = [op("embed")]
    for i in range(layers):
        ops += [op(f"attn{i}"), op(f"dispatch_a{i}"), DboYield("dispatch", i)]
        ops += [op(f"experts{i}"), op(f"combine_a{i}"), DboYield("combine", i)]
        ops += [op(f"output{i}")]
    return ops + [op("logits")]


def toy_hooks(log: list, runs: dict):
    def make_hook(ctx, point: DboYield):
        key = (ctx.index, point.launched, point.layer)
        runs[key] = 0

        def hook(waiter: str):
            assert waiter == f"mb{1 - ctx.index}"  # the other micro-batch runs it
            runs[key] += 1
            log.append(("recv", ctx.index, point.launched, threading.current_thread().name))

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
        (1, "embed"), (1, "attn0"), (1, "dispatch_a0"), ("recv", 0, "dispatch", "toy-mb1"),
        (0, "experts0"), (0, "combine_a0"), ("recv", 1, "dispatch", "toy-mb0"),
        (1, "experts0"), (1, "combine_a0"), ("recv", 0, "combine", "toy-mb1"),
        (0, "output0"), (0, "logits"), ("recv", 1, "combine", "toy-mb0"),
        (1, "output0"), (1, "logits"),
    ]  # fmt: skip
    assert guard.overlaps == 0
    assert runs == {(m, k, 0): 1 for m in (0, 1) for k in ("dispatch", "combine")}


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
    model_ops = [o for o in ops if not isinstance(o, DboYield)]
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
        "from moe_overlap.overlap.baton import DualBatchThreads, DboYield\n"
        "t = DualBatchThreads(5)\n"
        "ops = [lambda c, **kw: kw, DboYield('dispatch', 0), lambda c, **kw: {'ok': 1}]\n"
        "print(t.run([N(name='mb0'), N(name='mb1')], ops, lambda c, p: (lambda w: None)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[{'ok': 1}, {'ok': 1}]"


def test_second_wait_on_a_handle_is_free():
    # the receive hook waits on the other thread; the owner's dispatch_b / combine_b waits again
    work, out = Mock(**{"wait.return_value": True}), torch.ones(4, 2)
    handle = CommHandle(Group.single()._wait, work, out, "all_to_all")
    linked = InFlight(handle, ModelledLink(bytes_per_s=1e6), 50_000, "mb0", None)  # a 50 ms link
    assert linked.wait() is out and time.perf_counter() - linked.start >= 0.05
    start = time.perf_counter()
    assert linked.wait() is out and time.perf_counter() - start < 0.01
    assert work.wait.call_count == 1


# ---- the decision, as a pure function over the all-reduced table ----


def table(*columns):
    """Columns (tokens, vote) per rank; padded tokens = tokens, graph mode 0."""
    return torch.tensor([[t, t, v, 0] for t, v in columns], dtype=torch.int64).T


def test_thresholds_at_their_edges():
    cfg = OverlapConfig("dbo")
    assert not dbo_vote(31, True, cfg) and dbo_vote(32, True, cfg)
    assert not dbo_vote(511, False, cfg) and dbo_vote(512, False, cfg)
    decode = ForwardBatch(torch.zeros(32, dtype=torch.long), list(range(32)), [5] * 32, [1] * 32)
    decode.is_decode = [True] * 32
    assert dbo_local_column(decode, cfg) == [32, 32, 1, 0]
    decode.is_decode[0] = False  # one prefill token makes it MIXED: the prefill threshold
    assert dbo_local_column(decode, cfg) == [32, 32, 0, 0]
    assert dbo_local_column(ForwardBatch.idle(), cfg) == [0, 0, 0, 0]  # an idle rank votes no


def test_decide():
    assert (
        dbo_decide(table((10, 1), (10, 1))).run
        and dbo_decide(table((10, 1), (10, 1))).split_point == 5
    )
    no = dbo_decide(table((600, 1), (600, 0), (600, 1)))
    assert not no.run and "ranks [1] voted no" in no.reason
    idle = dbo_decide(table((40, 1), (0, 0)))  # an idle rank disables DBO for every rank
    assert not idle.run and "voted no" in idle.reason
    assert not dbo_decide(table((40, 1), (0, 1))).run  # even if it voted yes: empty last half
    padded = dbo_decide(table((40, 1), (21, 1)))  # pad to the max: both cut at 40 // 2
    assert padded.run and padded.split_point == 20
    abort = dbo_decide(table((40, 1), (20, 1)))  # rank 1 would have nothing past token 20
    assert not abort.run and "rank 1's last micro-batch would be empty" in abort.reason
    assert dbo_decide(table((3, 1))).split_point == 1
    with pytest.raises(ValueError, match="4 x ep"):
        dbo_decide(torch.zeros(3, 2, dtype=torch.int64))


def test_gather_table_on_one_rank():
    batch = ForwardBatch(torch.arange(6), [0], [0], [6])
    assert dbo_gather_table(batch, DBO, Group.single()).tolist() == [[6], [6], [1], [0]]


# ---- exactness: one process over a one-rank group, then ep=2 over gloo ----


def _runner(model, cfg):
    group = Group.single()
    return ModelRunner(model, AllToAllDispatcher(group, cfg.num_experts), 8, 64, None, group)


def _batch(seqs, decode=False):
    """seqs: (slot, prefix_len, token ids); prompt logits for every token unless decoding."""
    ids = torch.tensor([t for _, _, tokens in seqs for t in tokens])
    return ForwardBatch(
        ids,
        [s for s, _, _ in seqs],
        [p for _, p, _ in seqs],
        [len(t) for _, _, t in seqs],
        [not decode] * len(seqs),
        [decode] * len(seqs),
    )


LONG = [(7 * i) % 80 for i in range(45)]
SHORT_LONG = [(0, 0, [3, 4, 5]), (1, 0, [(5 * i + 1) % 80 for i in range(40)])]


@pytest.mark.parametrize("family", sorted(TINY))
def test_one_process_dbo_is_exact_and_really_overlaps(family):
    cfg = ModelConfig(**TINY[family])
    model = build_model(cfg, None, 0)
    plain, dbo = _runner(model, cfg), _runner(model, cfg)
    dbo.timeline.enabled = True
    scheme = dbo._scheme(DBO)
    steps = [
        _batch([(4, 0, LONG)]),  # a single long request: cut in two
        _batch(SHORT_LONG),  # short + long: the long one is cut
        _batch([(0, 3, [7]), (1, 40, [8]), (4, 45, [9])], decode=True),  # decode batch
        _batch([(0, 4, [1]), (1, 41, [2]), (2, 0, list(range(20, 32)))]),  # mixed
    ]
    steps[3].is_decode = [True, True, False]
    moe_layers = sum(layer.is_moe for layer in model.layers)
    for n, batch in enumerate(steps, start=1):
        want, got = plain.forward(batch), dbo.forward(batch, DBO)
        assert (want - got).abs().max().item() <= 1e-4
        assert torch.equal(want.argmax(-1), got.argmax(-1))
        assert scheme.num_overlapped == n
        baton = scheme.threads.last_run.baton
        assert baton.hooks_registered == baton.hooks_run == 2 * 2 * moe_layers
    tracks = {s.track for s in dbo.timeline.spans if s.name.startswith("dbo segment")}
    assert tracks == {"mb0", "mb1"}
    # one token, thresholds 1: split at 1 // 2 = 0, so micro-batch 0 is empty yet makes every call
    ones = OverlapConfig("dbo", dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)
    one = _batch([(5, 0, [42])])
    assert (plain.forward(one) - dbo.forward(one, ones)).abs().max().item() <= 1e-4
    baton = dbo._scheme(ones).threads.last_run.baton
    assert baton.hooks_registered == baton.hooks_run == 2 * 2 * moe_layers
    for overlap in (DBO, ones):
        dbo._scheme(overlap).close()


def _spy_dbo_steps(llm) -> list[list[bool]]:
    """Per step, which ranks ran DBO (their timelines hold 'dbo segment' spans)."""
    steps, run = [], llm.executor.run

    def recording(batches, overlap=None, record=False):
        logits = run(batches, overlap, record=True)
        steps.append(
            [any(s.name.startswith("dbo") for s in spans) for spans in llm.executor.last_spans]
        )
        return logits

    llm.executor.run = recording
    return steps


EP_CASES = {
    **CASES,
    "two-long": [LONG, [(5 * i + 1) % 80 for i in range(40)]],  # one per rank, each cut
    "decode-batch": [[i + 1, i + 2] for i in range(8)],
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_ep2_dbo_matches_one_process(family):
    cfg = ModelConfig(**TINY[family])
    with LLM(config=cfg, **KW) as llm:
        base = {c: llm.generate(p, PARAMS, return_logits=True) for c, p in EP_CASES.items()}
    ran = {}
    with LLM(config=cfg, ep=2, overlap=DBO, **KW) as llm:
        steps = _spy_dbo_steps(llm)
        for case, prompts in EP_CASES.items():
            start = len(steps)
            assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))
            assert all(len(set(ranks)) == 1 for ranks in steps[start:])  # ranks agree
            ran[case] = sum(ranks[0] for ranks in steps[start:])
    assert ran["single-long"] == 0  # rank 1 is idle throughout: nobody micro-batches
    assert ran["two-long"] > 0 and ran["decode-batch"] > 0 and ran["mixed-batch"] > 0
