"""Every KV page and slot an engine hands out comes back: after its requests finish or are
aborted the scheduler's count and the rank's pool are whole again (one-process engines, so the
rank's ``KVCache`` is in reach)."""

from __future__ import annotations

from moe_overlap import LLM, ModelConfig, SamplingParams
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import TINY


def _prompt(j: int, n: int) -> list[int]:
    return [(11 * i * (j + 3) + 7 * j + 1) % 80 for i in range(n)]


def _whole(llm: LLM) -> None:
    """Nothing held: every slot and page free, on the driver and (its releases applied by one
    more step) on the rank."""
    llm.step()  # an idle step carries the last released slots to the rank
    sched, kv = llm.scheduler, llm.executor.runner.kv_cache
    assert len(sched.slots[0]) == sched.slots[0].num_slots
    assert sched.pages[0].free == sched.pages[0].total
    assert kv.free_pages == kv.num_pages and not any(kv.held)


def test_requests_aborted_inside_a_pdmux_wave_give_their_pages_back():
    """A request aborted while its PD-mux prefill wave runs is freed when the wave ends. With
    nothing else queued the scheduler reported no work, so the wave never ended and its
    requests kept their slots and pages, on the driver and the rank, until traffic came."""
    cfg = ModelConfig(**TINY["deepseek_v3"])  # 3 layers: a wave of 3 layer ranges
    kw = dict(enable_pdmux=True, enable_prefix_caching=False, page_size=4, max_model_len=64)
    with one_thread(), LLM(config=cfg, seed=0, max_num_seqs=4, **kw) as llm:
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        reqs = [llm.make_request("p", _prompt(j, 30), params) for j in range(3)]
        for req in reqs:
            llm.scheduler.add(req)
        llm.step()  # the wave's first layer range
        assert llm.scheduler.pdmux.in_wave(reqs[0])
        llm.scheduler.abort(reqs)
        while llm.scheduler.has_work():
            llm.step()
        _whole(llm)


def _state_bytes(states) -> int:
    """What a rank's recurrent-state cache holds now: every slot's state, the prefix-cache
    snapshots, and the states a verify forward kept after each of its rows."""
    kept = [t for layer in states.kept.values() for k in layer.values() for t in (k.window, k.ssm)]
    held = states.allocated_bytes() + states.snapshots.allocated_bytes()
    return held + sum(t.numel() * t.element_size() for t in kept)


def test_a_hybrid_models_verify_states_are_inside_the_budget():
    """Qwen3.5 under speculative decoding: a verify forward keeps each sequence's recurrent
    state after every one of its rows, until the next forward settles them. The budget counted
    one state per running sequence (and the snapshots), so the kept ones, drafts + 1 for each
    sequence, came on top of it."""
    cfg = ModelConfig.from_hf("configs/qwen3_5-moe-tiny.json")
    ngram = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    kw = dict(max_num_seqs=4, max_model_len=64, page_size=4, enable_prefix_caching=False)
    with one_thread(), LLM(config=cfg, seed=0, kv_cache_memory=2 * 10**6, **kw, **ngram) as llm:
        params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
        for j in range(4):  # repeating prompts: the n-gram drafter finds drafts
            llm.scheduler.add(llm.make_request("p", [j + 1, 2, 3] * 6, params))
        most = 0
        while llm.scheduler.has_work():
            llm.step()
            most = max(most, _state_bytes(llm.executor.runner.states))
        assert llm.scheduler.speculation.stats.verifications > 0
        assert 0 < most <= llm.spec.state_total
