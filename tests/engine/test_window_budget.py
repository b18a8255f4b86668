"""Admission counts the sliding-window layers at their windows: where the budget gives those
layers a pool of their own sized for the running sequences' windows (prefix caching on or off), the
rest holds more full pages, so more sequences run at once; counted without a model, then on a
real engine whose smaller sliding pool never runs out and whose tokens match an ample pool."""

from __future__ import annotations

import dataclasses

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.engine.request import Request
from moe_overlap.engine.scheduler import Scheduler
from tests.engine.test_kv_budget import _decode_reply
from tests.engine.test_prefix_exact import GREEDY, KW, WAVES, gpt_oss, one_thread


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


def prompts(n: int, shared: int) -> list[list[int]]:
    """``n`` 1,000-token prompts, the first ``shared`` tokens the same in all."""
    return [[1] * shared + [2 + i % 70, 3 + i // 70] + [1] * (998 - shared) for i in range(n)]


def run_with_rank(spec: EngineSpec, ids: list[list[int]], steps: int) -> tuple[int, int, int]:
    """The scheduler with prefix caching over ``ids`` (100 new tokens each), each step's page
    changes applied to a KV cache of one sliding and one full layer as the rank does (no model):
    after every step the scheduler's count of the sliding pool is what that cache holds.
    Returns the most requests running at once, the prompt tokens found cached and the cached
    pages whose sliding page went back."""
    assert spec.window_budget is not None
    window, pages = spec.window_budget
    sched = Scheduler(1, spec.num_slots, spec.max_len, 8192, None, "round_robin", None,
                      spec.pool_pages, spec.page_size, True, windows=(window, pages))  # fmt: skip
    kv = KVCache(2, spec.num_slots, spec.max_len, {"k": (1,)}, num_pages=spec.pool_pages,
                 windows=[window, 0], window_pages=pages)  # fmt: skip
    pool, most, dropped = sched.prefix[0].windows, 0, 0
    for n in range(steps):
        for i in [0] if n == 0 else range(1, len(ids)) if n == 1 else []:  # one, then the rest
            sched.add(Request(i, ids[i], SamplingParams(max_new_tokens=100, ignore_eos=True)))
        step = sched.schedule()
        batch, most = step.batches[0], max(most, len(sched.running[0]))
        kv.apply(step.pages[0])
        dropped += len(step.pages[0].unwindow)
        kv.trim_windows(batch.slots, batch.prefix_lens)
        kv.reserve(batch.slots, batch.seq_lens)  # raises if the pool ran out
        assert pool is not None and pool.total - pool.free == kv.window_pages_used
        sched.update(step, _decode_reply(step))
    return most, sched.prefix[0].hits, dropped


def test_prefix_caching_keeps_the_window_saving_and_the_ranks_count():
    """GPT-OSS-120B on 4 GiB with prefix caching on: 87 sequences of 1,000 tokens at once
    where every page keeps its sliding page (57); a cached page's sliding page goes back once
    below every window and wanted for a growing sequence, and the scheduler's count of that
    pool stays the rank's, with distinct prompts and with half of each prompt shared."""
    cfg = ModelConfig.from_hf("configs/gpt-oss-120b.json")
    spec = EngineSpec(cfg, max_len=8192, kv_cache_bytes=4 * 2**30, dtype="bfloat16",
                      max_num_seqs=128, sliding_budget=True)  # fmt: skip
    every_layer = dataclasses.replace(spec, sliding_budget=False)
    assert (every_layer.max_concurrent(1000), spec.max_concurrent(1000)) == (57, 87)
    most, hits, dropped = run_with_rank(spec, prompts(128, 0), 24)
    assert (most, hits) == (87, 0) and dropped > 0
    most, hits, dropped = run_with_rank(spec, prompts(128, 496), 30)
    assert (most, hits) == (128, 127 * 496) and dropped > 0  # every slot, every later one hits


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
            assert sched.prefix[0].windows is not None and cache.windows.total == 44
            while sched.has_work():
                llm.step()  # a step that overflowed the pool would raise here
                most = max(most, len(sched.running[0]))
                if not sched.pages[0].released:  # no release the rank has yet to hear of
                    pool = sched.prefix[0].windows
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
        pool = sched.prefix[0].windows
        assert 0 <= pool.free <= pool.total
        fed.append([n for _, n in step.scheduled[0]])
        sched.update(step, _decode_reply(step))
    assert fed[0] == [20, 20] and sched.preemptions > 0


def test_a_sliding_pool_that_cannot_shrink_is_the_full_pools_size():
    """Where every running sequence's window and a step's chunks would need all the pages the
    budget buys, the sliding layers get no pool of their own. They got one capped at that count,
    and the full pages bought with the bytes left over came to one more (92 full, 91 sliding
    pages), so four 23-page sequences fit the full pool, the start-up line said they ran at
    once, and prefilling them together overflowed the sliding pool: one was preempted."""
    cfg = ModelConfig.from_hf("configs/gpt-oss-tiny.json")  # windows of 128 keys
    kw = dict(max_num_seqs=8, max_model_len=512, page_size=16, max_num_batched_tokens=2048)
    with one_thread(), LLM(config=cfg, seed=0, kv_cache_memory=3 * 10**6, **kw) as llm:
        spec, tokens = llm.spec, 23 * 16
        assert spec.window_pages == spec.num_pages  # 8 windows and a step: more than the pages
        n = spec.max_concurrent(tokens)
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        for j in range(n):
            llm.scheduler.add(
                llm.make_request("p", [(7 * i + j) % 500 for i in range(360)], params)
            )
        llm.step()  # every prompt prefilled in one step
        assert len(llm.scheduler.running[0]) == n and llm.scheduler.preemptions == 0
