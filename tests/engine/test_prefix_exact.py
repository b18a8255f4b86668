"""Prefix caching is exact on real gloo ranks: 16 requests sharing a 300-token prefix in two
waves (the second finds the prefix cached, on each rank that holds it) give the greedy tokens
and log-probabilities of a one-process engine without the cache, in every overlap mode at ep=2,
under DP attention with MLA, for sliding-window layers, for a hybrid linear-attention model
(its recurrent state kept at the cached prefix's end and restored), and after evictions from a
small pool, and under PD multiplexing (a wave starts after a prompt's cached pages).

Starting ranks costs seconds on two busy cores, so one engine per layout runs every mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.model_config import ModelConfig as Config
from tests.helpers import TINY, every_mode, force_overlap

PREFIX = [(7 * i + 3) % 80 for i in range(300)]
WAVES = [[PREFIX + [(16 * w + i) % 80, (5 * i + w) % 80] for i in range(8)] for w in range(2)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=0)
KW = dict(seed=0, max_model_len=320, max_num_batched_tokens=512)  # wave 1 prefills in chunks
WAVE_HITS = 8 * 288  # every request of wave 2: 18 full pages of 16 (its last token computed)
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")


@contextmanager
def one_thread() -> Iterator[None]:
    """A one-process engine on one intra-op thread: two threads on two busy cores run these
    tiny matrices up to a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def config(family: str) -> Config:
    return ModelConfig(**(TINY[family] | dict(max_position_embeddings=320)))


def qwen3_5() -> Config:
    """Qwen3.5 in two layers: a linear-attention layer and a full one."""
    raw = json.loads(Path("configs/qwen3_5-moe-tiny.json").read_text())
    raw |= dict(hidden_size=32, vocab_size=80, moe_intermediate_size=16)
    raw |= dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return ModelConfig.from_hf(raw | dict(max_position_embeddings=320))


def two_waves(llm: LLM, cached: bool = True, per_wave: int = 8) -> tuple[list, int]:
    """Both waves from a cold cache (or with the cache off: the reference, on the same
    engine); the outputs and the prompt tokens found cached."""
    for cache in llm.scheduler.prefix:
        cache.flush()
        cache.enabled = cached
    hits = sum(c.hits for c in llm.scheduler.prefix)
    outs = [out for wave in WAVES for out in llm.generate(wave[:per_wave], GREEDY)]
    return outs, sum(c.hits for c in llm.scheduler.prefix) - hits


def assert_same(base: list, got: list) -> None:
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
        assert max(diffs) <= 1e-4


def every_mode_matches_no_cache(llm: LLM) -> None:
    base, _ = two_waves(llm, cached=False)
    for mode, overlap in every_mode().items():
        if mode not in MODES:
            continue
        force_overlap(llm, overlap)
        outs, hits = two_waves(llm)
        assert_same(base, outs)
        assert hits == WAVE_HITS, mode  # each rank found the prefix its wave-1 share left


def two_turns(llm: LLM, cached: bool) -> tuple[list, int]:
    """Two conversations, one a rank: 14-token prompts answered in 20 tokens, then each
    prompt and answer followed by 5 more tokens; the outputs, and the second turn's prompt
    tokens found cached."""
    for cache in llm.scheduler.prefix:
        cache.flush()
        cache.enabled = cached
    turn = [[(3 * i + c) % 80 for i in range(14)] for c in range(2)]
    answer = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True, logprobs=0)
    first = llm.generate(turn, answer)
    hits = sum(c.hits for c in llm.scheduler.prefix)
    later = [p + out.token_ids + [1, 2, 3, 4, 5] for p, out in zip(turn, first, strict=True)]
    outs = first + llm.generate(later, GREEDY)
    return outs, sum(c.hits for c in llm.scheduler.prefix) - hits


def test_ep2_every_mode_from_the_cache_matches_no_cache():
    with LLM(config=config("qwen3_moe"), ep=2, **KW) as llm:
        every_mode_matches_no_cache(llm)


def test_ep2_every_mode_hybrid_from_kept_states_matches_no_cache():
    """Qwen3.5's linear-attention layer keeps its state after the prefix's last full page
    (inside wave 1's prefill chunk, and by a two-chunk cut's piece that crosses it); wave 2
    restores it and prefills only its own tokens. A second turn of a conversation finds its
    first turn's prompt and answer: 33 tokens computed, so 2 pages and the state the decode
    step that reached 32 kept (the one at 16 given back then; none from the prompt alone)."""
    with LLM(config=qwen3_5(), ep=2, **KW) as llm:
        every_mode_matches_no_cache(llm)
        force_overlap(llm, every_mode()["none"])
        base, _ = two_turns(llm, cached=False)
        outs, hits = two_turns(llm, cached=True)
    assert_same(base, outs)
    assert hits == 2 * 32


def test_dp_attention_with_mla_caches_per_rank_and_stays_exact_through_evictions():
    """Two attention-DP ranks, each its own pool and cache: a wave-2 request hits only on the
    rank that holds the prefix; a pool of 24 pages per rank (three requests sharing the
    prefix's 18, less than the two waves leave cached) evicts and still gives the same
    tokens."""
    layout = dict(tp=2, dp=2, enable_dp_attention=True, max_total_tokens=24 * 16)
    with LLM(config=config("deepseek_v3"), **layout, **KW) as llm:
        base, _ = two_waves(llm, cached=False)
        outs, hits = two_waves(llm)
        assert_same(base, outs)
        caches = llm.scheduler.prefix
    assert hits >= WAVE_HITS and all(c.hits > 0 for c in caches)  # each rank its own share
    assert sum(c.evictions for c in caches) > 0


def gpt_oss() -> Config:
    """One sliding layer (a 64-key window, so the 300-token prefix crosses it) and a full one."""
    raw = json.loads(Path("configs/gpt-oss-tiny.json").read_text())
    raw |= dict(hidden_size=32, head_dim=8, intermediate_size=16, vocab_size=80)
    raw |= dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    return ModelConfig.from_hf(raw | dict(sliding_window=64, max_position_embeddings=320))


def test_ep2_sliding_window_pages_leave_the_cache_and_hits_stay_exact():
    """GPT-OSS's sliding layer over 64 keys with its pool counted at the windows, cache on:
    three sequences at once per rank (38 sliding pages beside 60 full ones) and three requests
    a wave each, so cached pages' sliding pages below every window go back to make room;
    wave 2 still reads the window
    before its hit from the cache, and none and tbo+two-chunk (whose cut sequence's first
    piece reads its window) give the tokens of the cache off."""
    with LLM(config=gpt_oss(), ep=2, max_num_seqs=3, **KW) as llm:
        assert llm.spec.window_budget == (64, 38)
        base, _ = two_waves(llm, cached=False, per_wave=6)
        for mode in ("none", "tbo+two-chunk"):
            force_overlap(llm, every_mode()[mode])
            outs, hits = two_waves(llm, per_wave=6)
            assert_same(base, outs)
            assert hits == 6 * 288, mode
        pools = [c.windows for c in llm.scheduler.prefix]
    assert all(p is not None and p.given_back > 0 for p in pools)


def test_pdmux_waves_start_after_the_cached_pages():
    """PD multiplexing's waves prefill each prompt past its cached pages, in layer ranges on
    the prefill lane beside the decodes (one process: the lane's thread and the attach before
    it are what a hit changes): the tokens of the cache off."""
    pdmux = dict(enable_pdmux=True, pdmux_prefill_splits=2)
    with one_thread(), LLM(config=config("qwen3_moe"), **pdmux, **KW) as llm:
        base, _ = two_waves(llm, cached=False, per_wave=4)
        outs, hits = two_waves(llm, per_wave=4)
    assert_same(base, outs)
    assert hits == 4 * 288
