"""The MTP drafter's keys and values in the engine's paged KV cache (``model/caches.py``): the
budget counts the MTP layers as the rank's cache holds them; the scheduler holds pages for the
rows the drafter writes past a step's tokens; on a real engine (one process, tiny DeepSeek-V3
with one MTP layer, fp32) many sequences through a tight pool, released, reused and preempted,
keep every page the rank takes inside the scheduler's count and get plain decoding's tokens;
and the drafts are those of a drafter with a whole-context cache of its own (the old one)."""

from __future__ import annotations

import dataclasses

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.engine_config import EngineSpec, kv_bytes_per_token
from moe_overlap.core.kv_cache import KVPoolExhausted
from moe_overlap.core.model_config import ModelConfig as Config
from moe_overlap.engine.scheduler import Scheduler
from moe_overlap.engine.spec_config import SpeculativeConfig
from moe_overlap.engine.speculation import Speculation
from moe_overlap.model.caches import kv_cache_for
from moe_overlap.runtime.mtp_drafter import MtpDrafter
from moe_overlap.runtime.rank import build_rank_runner
from tests.engine.test_kv_budget import _decode_reply, _request
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import TINY, glm4_hf_config, mimo_hf_config

CFG = ModelConfig(
    **(TINY["deepseek_v3"] | dict(num_nextn_predict_layers=1, max_position_embeddings=256))
)
MTP = dict(speculative_algorithm="EAGLE", speculative_num_steps=3)  # two rows past each step
GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    return [[(11 * i * (j + 3) + 7 * j) % 80 for i in range(5 + 7 * j % 41)] for j in range(n)]


def test_the_budget_counts_the_mtp_layers_as_the_ranks_cache_holds_them():
    """MLA (DeepSeek-V3), GQA (GLM-4.5) and MiMo-V2-Flash, whose MTP layer is a sliding one
    kept whole-context on the full pages: with MTP drafts a token's bytes include the MTP
    layer's, the pool has fewer pages for it, and the rank's cache, the drafter's too, takes
    exactly those bytes a page."""
    cases = {
        "deepseek_v3": CFG,
        "glm4_moe": Config.from_hf(glm4_hf_config(num_nextn_predict_layers=1).to_dict()),
        "mimo": Config.from_hf(mimo_hf_config(num_nextn_predict_layers=1).to_dict()),
    }
    budget = 2**22
    for name, cfg in cases.items():
        plain = EngineSpec(cfg, max_num_seqs=4, max_len=64, kv_cache_bytes=budget)
        spec = dataclasses.replace(plain, mtp_steps=2)
        layer = kv_bytes_per_token(cfg, mtp=True) - kv_bytes_per_token(cfg)
        assert layer > 0 and spec.token_bytes == plain.token_bytes + layer, name
        assert spec.num_pages == budget // (spec.token_bytes * spec.page_size) < plain.num_pages
        for s in (plain, spec):
            runner = build_rank_runner(s)
            kv = runner.kv_cache
            assert len(kv.layers) == cfg.num_hidden_layers + (s is spec), name
            assert (runner.mtp is not None) == (s is spec) and kv.num_pages == s.pool_pages
            if runner.mtp is not None:
                assert runner.mtp.kv_cache is kv  # one cache: the drafter has none of its own
            kv.allocate_all()  # page 0 too
            assert kv.allocated_bytes() == (kv.num_pages + 1) * kv.page_size * s.token_bytes


def test_the_scheduler_holds_pages_for_the_rows_the_drafter_writes_past_a_step():
    """MTP with three steps writes two rows past each step's tokens (its decode steps): the
    pages a sequence holds cover them, and a request whose run and those rows could never fit
    the pool is refused; n-gram drafts write none past the step."""
    mtp = Speculation(SpeculativeConfig("EAGLE", 3, 1, 12))
    assert (
        mtp.writes_ahead == 2
        and Speculation(SpeculativeConfig("NGRAM", 3, 1, 12)).writes_ahead == 0
    )
    held = {}
    for name, speculation in (("plain", None), ("mtp", mtp)):
        sched = Scheduler(1, 4, 64, 1024, None, "round_robin", None, 16, 4, speculation=speculation)
        sched.add(_request(0, 8, 4))  # 8 prompt tokens: 2 pages of 4
        step = sched.schedule()
        pages = [sched.running[0][0].pages]
        sched.update(step, _decode_reply(step))  # the prompt's token: decode at 8
        sched.schedule()
        held[name] = pages + [sched.running[0][0].pages]
    assert held == {"plain": [2, 3], "mtp": [3, 3]}  # rows 8, 9; then 9, 10 past 8
    sched = Scheduler(1, 4, 64, 1024, None, "round_robin", None, 3, 4, speculation=mtp)
    sched.add(_request(0, 8, 2))  # 10 tokens and two MTP rows: 3 pages
    with pytest.raises(ValueError, match="may reach 11 tokens, 4 KV pages of 4"):
        sched.add(_request(1, 8, 3))  # 11 tokens and two rows: 4 pages


def _check_pages(llm: LLM) -> list[int]:
    """After every step: each running sequence's pages on the rank are within those the
    scheduler holds for it, none is page 0, and no two sequences share one they own. Returns
    the running counts seen."""
    sched, kv, seen = llm.scheduler, llm.executor.runner.kv_cache, []
    update = sched.update

    def checked(step, reply):
        owned = []
        for req in sched.running[0]:
            held = kv.held[req.slot]
            assert len(held) <= req.pages, (req.request_id, len(held), req.pages)
            assert 0 not in held
            owned += [p for p in held if p not in kv.cached_pages]
        assert len(owned) == len(set(owned))
        seen.append(len(sched.running[0]))
        return update(step, reply)

    sched.update = checked
    return seen


def test_many_sequences_reuse_pages_within_the_schedulers_count(monkeypatch):
    """24 requests (5 to 45 prompt tokens, 20 new) through 6 slots and 40 pages of 4 tokens
    with prefix caching on: pages are released and reused, sequences are preempted by
    recompute, and every request gets plain decoding's tokens, the rank never taking a page the
    scheduler did not hold for the sequence (so ``KVPoolExhausted`` cannot fire and no write
    lands outside its pages). Not holding pages for the drafter's rows past each step (the
    count before the MTP layers shared the pool) breaks that within a few steps."""
    kw = dict(config=CFG, seed=0, max_num_seqs=6, page_size=4, max_model_len=96)
    prompts = _prompts(24)
    with one_thread(), LLM(**kw, max_total_tokens=160, **MTP) as llm:
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
        want = [o.token_ids for o in llm.generate(prompts, GREEDY)]  # the ranks draft anyway
        llm.scheduler.speculation = speculation
        seen = _check_pages(llm)
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == want
        assert speculation.stats.verifications > 0 and llm.scheduler.preemptions > 0
        assert max(seen) == 6 and llm.executor.runner.kv_cache.num_pages == 40
        monkeypatch.setattr(Speculation, "writes_ahead", property(lambda self: 0))
        llm.scheduler.ahead = 0
        with pytest.raises((AssertionError, KVPoolExhausted)):
            llm.generate(prompts, GREEDY)


def test_the_drafts_equal_a_drafter_with_a_whole_context_cache_of_its_own(monkeypatch):
    """Every step's drafts and the tokens equal those of the same engine whose drafter keeps
    its own cache, every slot at max_len and never released (the drafter before its layers
    joined the pool)."""
    drafted: list[list[list[int]]] = []
    draft = MtpDrafter.draft
    monkeypatch.setattr(
        MtpDrafter, "draft", lambda self, *a: drafted.append(draft(self, *a)) or drafted[-1]
    )
    prompts = _prompts(8)
    kw = dict(config=CFG, seed=0, max_num_seqs=8, page_size=8, enable_prefix_caching=False)
    with one_thread(), LLM(**kw, **MTP) as llm:
        runner = llm.executor.runner
        shared = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        shared_drafts, drafted[:] = list(drafted), []
        own = kv_cache_for(runner.model, 8, llm.max_len, mtp=True)  # every slot at max_len
        runner.mtp = MtpDrafter(runner.model, own, 3)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == shared
    assert drafted == shared_drafts and any(d for step in drafted for d in step)
