"""Dual batch overlap: the receive hook, the cross-rank decision, vLLM's op order, exactness at
ep=1 and ep=2, and the timeline of an ep=2 run (the baton protocol is in test_operations.py)."""

from __future__ import annotations

import dataclasses
import time
from unittest.mock import Mock

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.in_flight import InFlight
from moe_overlap.distributed.groups import CommHandle, Group
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.model.loader import build_model
from moe_overlap.overlap import dbo as dbo_module
from moe_overlap.overlap.agreement import (
    dbo_decide,
    dbo_gather_table,
    dbo_local_column,
    dbo_vote,
)
from moe_overlap.overlap.dbo import DualBatchOverlap
from moe_overlap.overlap.operations import Yield
from moe_overlap.runtime.model_runner import ModelRunner
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same

DBO = OverlapConfig("dbo", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)
ONES = OverlapConfig("dbo", dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)


def test_second_wait_on_a_handle_is_free():
    # the receive hook waits on the other thread; the owner's dispatch_b / combine_b waits again
    work, out = Mock(**{"wait.return_value": True}), torch.ones(4, 2)
    handle = CommHandle(Group.single()._wait, work, out, "all_to_all")
    linked = InFlight(handle, ModelledLink(bytes_per_s=1e6), 50_000, "mb0", None)  # a 50 ms link
    assert linked.wait() is out and time.perf_counter() - linked.start >= 0.05
    start = time.perf_counter()
    assert linked.wait() is out and time.perf_counter() - start < 0.04  # not the link again
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
    one = _batch([(5, 0, [42])])
    assert (plain.forward(one) - dbo.forward(one, ONES)).abs().max().item() <= 1e-4
    baton = dbo._scheme(ONES).threads.last_run.baton
    assert baton.hooks_registered == baton.hooks_run == 2 * 2 * moe_layers
    for overlap in (DBO, ONES):
        dbo._scheme(overlap).close()


def test_shared_experts_run_between_the_combine_send_and_its_receive(monkeypatch):
    """vLLM's order: a micro-batch yields after dispatch_a, and after combine_a plus the shared
    experts; the other micro-batch runs each receive before the owner goes on."""
    cfg = ModelConfig(**TINY["deepseek_v3"])
    runner, log = _runner(build_model(cfg, None, 0), cfg), []
    scheme = runner._scheme(DBO)

    def logged(op):
        def run(ctx, **kw):
            log.append((ctx.name, op.__name__.removeprefix("op_")))
            return op(ctx, **kw)

        return op if isinstance(op, Yield) else run

    def logged_hook(ctx, make=dbo_module.receive_hook):
        wait = make(ctx)
        return lambda waiter: log.append((ctx.name, f"receive by {waiter}")) or wait(waiter)

    scheme.ops = [logged(op) for op in scheme.ops]
    monkeypatch.setattr(dbo_module, "receive_hook", logged_hook)
    runner.forward(_batch(SHORT_LONG), DBO)
    scheme.close()
    moe = ("dispatch_a", "dispatch_b", "experts", "combine_a", "shared_experts", "combine_b")
    for me, other in (("mb0", "mb1"), ("mb1", "mb0")):
        mine = [name for who, name in log if who == me and (name in moe or "receive" in name)]
        by = f"receive by {other}"
        per_layer = ["dispatch_a", by, "dispatch_b", "experts", "combine_a", "shared_experts", by]
        assert mine == [*per_layer, "combine_b"] * sum(la.is_moe for la in scheme.model.layers)


def _spy_dbo_steps(llm) -> list[list[bool]]:
    """Per step, which ranks ran DBO (their timelines hold 'dbo segment' spans)."""
    steps, step = [], llm.executor.step

    def recording(request):
        reply = step(dataclasses.replace(request, record=True))
        steps.append([any(s.name.startswith("dbo") for s in spans) for spans in reply.spans])
        return reply

    llm.executor.step = recording
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


def test_ep2_timeline_records_each_wait_on_the_waiters_track():
    """Real all-to-alls: a receive hook's wait lands on the track of the micro-batch that runs
    it, and each micro-batch's compute on its own track."""
    cfg = ModelConfig(**TINY["deepseek_v3"])
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    with LLM(config=cfg, ep=2, overlap=ONES, **KW) as llm:
        batches = [ForwardBatch(torch.arange(n), [0], [0], [n]) for n in (9, 8)]
        for spans in llm.executor.run(batches, record=True).spans:
            tracks = {s.track for s in spans}
            assert {"mb0 wait", "mb1 wait"} <= tracks
            for me, other in (("mb0", "mb1"), ("mb1", "mb0")):
                waits = [s.name for s in spans if s.track == f"{me} wait"]
                run_by_me = [name for name in waits if name.startswith("receive hook for")]
                assert run_by_me == [f"receive hook for {other}"] * 2 * moe_layers
                segments = [s.name for s in spans if s.track == me]
                assert segments == [f"dbo segment {k}" for k in range(2 * moe_layers + 1)]


def test_dbo_aborts_its_own_group_on_a_stall():
    """A stall leaves a thread inside a collective: the scheme's threads abort its EP group
    (tests/distributed/test_collective_risks.py runs one over gloo)."""
    group = Group.single(name="ep")
    scheme = DualBatchOverlap(build_model(ModelConfig(**TINY["qwen3_moe"]), None, 0), DBO, group)
    try:
        assert scheme.threads.on_stall == group.abort
    finally:
        scheme.close()
