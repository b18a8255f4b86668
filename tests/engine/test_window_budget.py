"""Admission counts the sliding-window layers at their windows: where the budget gives those
layers a pool of their own sized for the running sequences' windows (prefix caching off), the
rest holds more full pages, so more sequences run at once; counted without a model, then on a
real engine whose smaller sliding pool never runs out and whose tokens match an ample pool."""

from __future__ import annotations

import dataclasses

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.engine.request import Request
from moe_overlap.engine.scheduler import Scheduler
from tests.engine.test_kv_budget import _decode_reply
from tests.engine.test_prefix_exact import GREEDY, KW, WAVES, one_thread
from tests.engine.test_prefix_layouts import gpt_oss


def gpt_oss_120b(**kw) -> EngineSpec:
    cfg = ModelConfig.from_hf("configs/gpt-oss-120b.json")  # 18 of 36 layers slide over 128
    return EngineSpec(cfg, max_len=cfg.max_len(), kv_cache_bytes=16 * 2**30, dtype="bfloat16",
                      max_num_seqs=512, **kw)  # fmt: skip


def most_running(spec: EngineSpec, steps: int = 60) -> int:
    """The most 1,000-token requests (100 new tokens each) the scheduler runs at once."""
    sched = Scheduler(1, spec.num_slots, spec.max_len, 8192, None, "round_robin", None,
                      spec.pool_pages, spec.page_size, windows=spec.window_budget)  # fmt: skip
    for i in range(512):
        sched.add(Request(i, [1] * 1000, SamplingParams(max_new_tokens=100, ignore_eos=True)))
    most = 0
    for _ in range(steps):
        step = sched.schedule()
        most = max(most, len(sched.running[0]))
        sched.update(step, _decode_reply(step))
    return most


def test_gpt_oss_120b_runs_more_sequences_with_its_sliding_layers_at_their_windows():
    every_layer, windows = gpt_oss_120b(), gpt_oss_120b(sliding_budget=True)
    # the sliding pool: 512 sequences' windows (8 pages of 16) and 2 pages each, and a step's
    # 8,192 prefill tokens
    assert every_layer.window_budget is None and windows.window_budget == (128, 5632)
    assert (every_layer.max_concurrent(1000), windows.max_concurrent(1000)) == (231, 372)
    assert "sliding-window layers: 5632 pages" in windows.kv_cache_summary()
    assert (most_running(every_layer), most_running(windows)) == (231, 372)


def test_a_smaller_sliding_pool_is_counted_as_the_rank_holds_it_and_gives_the_same_tokens():
    """Two layers, one sliding over 64 keys: 70 pages of both, or 80 full pages (four slots'
    worth) and 44 of the sliding layer's (four windows and a 320-token prefill); eight
    302-token prompts then run four at once, not three. After every step the scheduler's
    count of the sliding pool is what the rank's cache holds."""
    cfg = gpt_oss()
    kw = KW | dict(enable_prefix_caching=False, max_num_seqs=4)
    with one_thread():
        with LLM(config=cfg, **kw) as llm:
            base = llm.generate(WAVES[0], GREEDY)
        page_bytes = llm.spec.token_bytes * llm.spec.page_size
        with LLM(config=cfg, kv_cache_memory=70 * page_bytes, **kw) as llm:
            spec, sched = llm.spec, llm.scheduler
            assert (spec.pool_pages, spec.window_budget) == (80, (64, 44))
            assert dataclasses.replace(spec, sliding_budget=False).pool_pages == 70
            reqs = [llm.make_request("p", p, GREEDY) for p in WAVES[0]]
            for req in reqs:
                sched.add(req)
            most, cache = 0, llm.executor.runner.kv_cache
            assert sched.windows is not None and cache.window_total == 44
            while sched.has_work():
                llm.step()  # a step that overflowed the pool would raise here
                most = max(most, len(sched.running[0]))
                if not sched.pages[0].released:  # no release the rank has yet to hear of
                    pool = sched.windows[0]
                    assert pool.total - pool.free == cache.window_pages_used
    assert most == 4
    for want, got in zip(base, reqs, strict=True):
        assert want.token_ids == got.output_ids
        diffs = [
            abs(a.logprob - b.logprob) for a, b in zip(want.logprobs, got.logprobs, strict=True)
        ]
        assert max(diffs) <= 1e-4


def test_a_step_waits_for_sliding_pages_and_preempts_the_newest_when_none_come_back():
    """A sliding pool of 12 pages of 4 tokens (window 8): two 20-token prompts prefill in one
    step (5 pages each), the third waits; their decodes hold 3 or 4 pages each, so when the
    third joins, a growing step finds too few and the newest request is preempted; no step's
    count leaves the pool."""
    sched = Scheduler(1, 4, 64, 64, None, "round_robin", None, 64, 4, windows=(8, 12))
    for i in range(3):
        sched.add(Request(i, [1] * 20, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    fed = []
    while sched.has_work():
        step = sched.schedule()
        pool = sched.windows[0]
        assert 0 <= pool.free <= pool.total
        fed.append([n for _, n in step.scheduled[0]])
        sched.update(step, _decode_reply(step))
    assert fed[0] == [20, 20] and sched.preemptions > 0
