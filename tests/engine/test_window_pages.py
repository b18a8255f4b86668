"""Sliding-window layers keep only their window: their pages wholly below every sequence's
window go back to their own pool as it grows (full-attention layers keep theirs), but for
cached pages, which stay the cache's (a later request may cut at them) until the driver gives
them back; and a long generation gives exactly the tokens
and log-probabilities of the same engine keeping every page."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.kv_cache import NULL_PAGE, KVCache
from moe_overlap.core.step import PageOps
from tests.engine.test_prefix_exact import one_thread

PAGE, WINDOW = 4, 8


def cache() -> KVCache:
    """Layer 0 slides over 8 keys, layer 1 is full."""
    return KVCache(2, 4, 64, {"k": (1, 2)}, page_size=PAGE, num_pages=40, windows=[WINDOW, 0])


def grow(kv: KVCache, slot: int, start: int, end: int) -> None:
    """One forward of ``slot`` computing positions ``[start, end)``."""
    kv.trim_windows([slot], [start])
    kv.reserve([slot], [end])


def test_a_growing_sequence_keeps_only_its_window_in_the_sliding_layers():
    kv = cache()
    grow(kv, 0, 0, 20)  # a 20-token prefill: 5 pages in each table
    assert (kv.window_pages_used, kv.free_pages) == (5, 35)
    grow(kv, 0, 20, 21)  # the query at 20 sees keys 13..20: pages 0-2 (keys 0..11) go
    assert kv.windows.held[0][:3] == [NULL_PAGE] * 3 and kv.window_pages_used == 3
    assert kv.windows.table[0, :3].tolist() == [NULL_PAGE] * 3
    for pos in range(21, 60):  # a long decode: never more than its window's pages
        grow(kv, 0, pos, pos + 1)
        assert kv.window_pages_used <= -(-WINDOW // PAGE) + 1
    assert len(kv.held[0]) == 15 and kv.free_pages == 25  # the full layer keeps every page
    kv.release([0])
    assert kv.window_pages_used == 0 and kv.free_pages == 40


def test_stored_keys_inside_the_window_read_back_after_trimming():
    kv = cache()
    keys = torch.arange(24, dtype=torch.float32).view(12, 1, 2)
    kv.reserve([1], [12])
    for layer in (0, 1):
        kv.store(layer, torch.ones(12, dtype=torch.long), torch.arange(12), k=keys)
    kv.trim_windows([1], [12])  # keys 5..11 stay visible: pages 1 and 2 stay
    assert torch.equal(kv.gather(0, "k", [1], 12, 4)[0], keys[4:])
    assert torch.equal(kv.gather(0, "k", [1], 4)[0], torch.zeros(4, 1, 2))  # the null page
    assert torch.equal(kv.gather(1, "k", [1], 12)[0], keys)  # the full layer: every key


def test_a_cached_page_keeps_its_window_page_until_the_driver_gives_it_back():
    kv = cache()
    grow(kv, 0, 0, 12)
    kv.apply(PageOps(publish=[(0, 0, 7), (0, 1, 8), (0, 2, 9)]))  # pages 0-2 cached
    grow(kv, 0, 12, 20)
    grow(kv, 0, 20, 24)  # pages 0-2 fall below the window: they leave the row, kept cached
    assert kv.windows.held[0][:3] == [NULL_PAGE] * 3 and kv.window_pages_used == 6
    kv.apply(PageOps(released=[0], unwindow=[7], attach=[(1, [7, 8, 9])]))  # a cut at 12
    assert kv.windows.held[1] == [NULL_PAGE, kv.windows.cached[8], kv.windows.cached[9]]
    assert kv.window_pages_used == 2  # 8 and 9: the window of the query at 12 reads 5..11
    grow(kv, 1, 12, 30)
    grow(kv, 1, 30, 31)  # keys 23..30: pages 0-4 leave the row, 8 and 9 stay cached
    assert kv.windows.held[1][:5] == [NULL_PAGE] * 5 and kv.window_pages_used == 2 + 3
    kv.apply(PageOps(released=[1], evict=[7, 8, 9]))
    assert kv.window_pages_used == 0 and kv.free_pages == 40


def gpt_oss(window: int) -> ModelConfig:
    raw = json.loads(Path("configs/gpt-oss-tiny.json").read_text())
    raw |= dict(hidden_size=32, head_dim=8, intermediate_size=16, vocab_size=80)
    raw |= dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    return ModelConfig.from_hf(raw | dict(sliding_window=window, max_position_embeddings=256))


def test_a_long_generation_with_a_small_window_is_exact_and_gives_pages_back():
    prompts = [[(5 * i + j) % 80 for i in range(30)] for j in range(2)]
    greedy = SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True, logprobs=0)
    kw = dict(seed=0, page_size=PAGE, max_num_batched_tokens=16, enable_prefix_caching=False)
    with one_thread(), LLM(config=gpt_oss(12), **kw) as llm:
        kv = llm.executor.runner.kv_cache
        reserve, most = kv.reserve, [0]

        def counting(slots, ends):  # the sliding layers' pages in use at their peak
            reserve(slots, ends)
            most[0] = max(most[0], kv.window_pages_used)

        kv.reserve = counting
        trimmed, peak = llm.generate(prompts, greedy), most[0]
        kv.trim_windows = lambda slots, starts: None  # the reference: every page kept
        kept = llm.generate(prompts, greedy)
    assert 0 < peak <= 2 * 9  # each sequence: its 12-key window and a 16-token chunk
    assert most[0] >= 2 * 19  # every page of 79 tokens each, 4 a page
    for a, b in zip(kept, trimmed, strict=True):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]
