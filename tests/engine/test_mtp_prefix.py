"""Prefix caching under MTP drafts: a cached page carries the MTP layers' entries its writer
computed, and its key holds the token after it (``engine/page_keys.py``), so a hit reads only
entries computed from its own tokens. One process: the MTP head's logits at every drafting
step of a request that hits a prefix another request wrote (followed by another token there)
equal those with the cache off, and keying pages without that token gives other logits. Real
ep=2 gloo ranks: two waves sharing a prefix, greedy and seeded sampled requests, get the tokens
they get with the cache off, with hits and verify steps; and so do a hybrid model's (Qwen3.5),
whose recurrent state a hit restores."""

from __future__ import annotations

import dataclasses

import torch

from moe_overlap import LLM, SamplingParams
from moe_overlap.runtime.mtp_drafter import MtpDrafter
from tests.engine.test_hybrid_speculative import MTP as QWEN3_5_MTP
from tests.engine.test_hybrid_speculative import VOCAB
from tests.engine.test_mtp_pages import CFG
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import max_abs_diff

MTP = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)
PREFIX = [(7 * i + 3) % 80 for i in range(32)]  # four pages of 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SAMPLED = dataclasses.replace(GREEDY, temperature=1.0, seed=5)


def _drafting_logits(llm: LLM, prompt: list[int], params: SamplingParams, monkeypatch):
    """The MTP head's logits at each of ``prompt``'s drafting steps, and its tokens."""
    seen: list[torch.Tensor] = []
    pick = MtpDrafter._pick

    def record(self, logits, plan, step):
        seen.append(logits.clone())
        return pick(self, logits, plan, step)

    with monkeypatch.context() as m:
        m.setattr(MtpDrafter, "_pick", record)
        tokens = llm.generate([prompt], params)[0].token_ids
    return seen, tokens


def _hit_after_another(llm: LLM, follows: int, params: SamplingParams, monkeypatch):
    """PREFIX + [1, 2] once, then PREFIX + [9, 2] (the same pages, another token after them):
    the second's drafting logits and tokens, and the prompt tokens it found cached."""
    (cache,) = llm.scheduler.prefix
    cache.flush()
    cache.enabled, cache.follows = True, follows
    llm.generate([PREFIX + [1, 2]], params)
    hits = cache.hits
    logits, tokens = _drafting_logits(llm, PREFIX + [9, 2], params, monkeypatch)
    return logits, tokens, cache.hits - hits


def test_a_hit_drafts_as_the_cache_off_run_does(monkeypatch):
    """Greedy and seeded sampled: with the cache off, then on (it hits the three pages whose
    next token it shares; the fourth's last MTP entry embeds the other request's token), every
    drafting step's MTP logits (1e-5) and the tokens are the same. Keying pages without the
    next token, the hit takes all four pages and its logits differ, and so do the sampled
    request's tokens (what made sampled MTP requests skip the cache before)."""
    with one_thread(), LLM(config=CFG, seed=0, page_size=8, **MTP) as llm:
        (cache,) = llm.scheduler.prefix
        for params in (GREEDY, SAMPLED):
            cache.flush()
            cache.enabled = False
            want, tokens = _drafting_logits(llm, PREFIX + [9, 2], params, monkeypatch)
            got, same, hits = _hit_after_another(llm, 1, params, monkeypatch)
            assert hits == 24 and same == tokens
            assert len(got) == len(want) > 8
            assert max(max_abs_diff(a, b) for a, b in zip(got, want, strict=True)) <= 1e-5
            stale, other, hits = _hit_after_another(llm, 0, params, monkeypatch)
            assert hits == 32  # the fourth page too, its last MTP entry the other request's
            assert max_abs_diff(stale[0], want[0]) > 1e-2
        assert other != tokens  # sampled: q, and with it the seeded tokens, changed


def test_mtp_with_prefix_hits_gives_the_cache_off_tokens_at_ep2():
    """Two waves of eight requests sharing a 64-token prefix (half of the second wave with the
    token after it that a first-wave request had, half with another), three greedy and one
    seeded sampled in four: the tokens with the cache on equal those with it off; the second
    wave hit the prefix, whole or but its last page, and verify steps ran."""
    prefix = [(5 * i + 1) % 80 for i in range(64)]
    first = [prefix + [3 * i, i] for i in range(8)]
    waves = [first, [prefix + [3 * i if i % 2 else 50 + i, 40 + i] for i in range(8)]]
    params = [SAMPLED if i % 4 == 3 else GREEDY for i in range(8)]
    with LLM(config=CFG, ep=2, seed=0, page_size=8, **MTP) as llm:
        runs, hits = {}, {}
        for cached in (False, True):
            for cache in llm.scheduler.prefix:
                cache.flush()
                cache.enabled = cached
            before = sum(c.hits for c in llm.scheduler.prefix)
            runs[cached] = [[o.token_ids for o in llm.generate(wave, params)] for wave in waves]
            hits[cached] = sum(c.hits for c in llm.scheduler.prefix) - before
        assert runs[True] == runs[False]
        assert hits[False] == 0 and hits[True] >= 8 * 56
        assert llm.scheduler.speculation.stats.verifications > 0


def test_a_hybrid_models_mtp_prefix_hits_give_the_cache_off_tokens():
    """Qwen3.5 (a linear-attention layer, its recurrent state kept at cached page boundaries,
    and one MTP layer): requests sharing a 48-token prefix, greedy and seeded sampled, get the
    tokens they get with the cache off, with hits (the state's boundaries found under keys
    that hold the next token)."""
    prefix = [(5 * i + 1) % VOCAB for i in range(48)]
    prompts = [prefix + [i % VOCAB, 3 * i % VOCAB] for i in range(6)]
    params = [GREEDY, SAMPLED] * 3
    with one_thread(), LLM(config=QWEN3_5_MTP, seed=0, page_size=8, **MTP) as llm:
        (cache,) = llm.scheduler.prefix
        runs, hits = {}, {}
        for cached in (False, True):
            cache.flush()
            cache.enabled, before = cached, cache.hits
            runs[cached] = [llm.generate(prompts[:2], params[:2]), llm.generate(prompts, params)]
            runs[cached] = [[o.token_ids for o in run] for run in runs[cached]]
            hits[cached] = cache.hits - before
    assert runs[True] == runs[False] and hits == {False: 0, True: 48}
