"""The KV cache budget: sized by memory, counted in pages, logged; no model is allocated."""

from __future__ import annotations

import dataclasses

import pytest

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.kv_budget import CPU_FREE_RAM_SHARE, cpu_kv_bytes, gpu_kv_bytes, pages_for
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.step import GroupReply, StepReply
from moe_overlap.engine.kv_memory import weight_bytes
from moe_overlap.engine.request import Request, SamplingParams
from moe_overlap.engine.scheduler import Scheduler

QWEN3_30B = "configs/qwen3-30b-a3b.json"


def qwen3_30b(**kw) -> EngineSpec:
    cfg = ModelConfig.from_hf(QWEN3_30B)
    return EngineSpec(cfg, max_len=40960, kv_cache_bytes=16 * 2**30, dtype="bfloat16", **kw)


def test_qwen3_30b_a3b_at_full_context_holds_160_sequences_of_1000_tokens_in_16_gib():
    spec = qwen3_30b()
    assert spec.token_bytes == 96 * 2**10  # 48 layers x 4 KV heads x (128 + 128) x 2 bytes
    assert spec.num_pages * spec.page_size == 174_752  # 16 GiB / 96 KiB, whole pages
    assert spec.max_concurrent(1000) >= 160
    assert spec.max_concurrent(40960) == 4  # whole-context sequences: what slots allowed


def test_max_total_tokens_caps_the_pool_and_the_summary_names_the_numbers():
    spec = qwen3_30b(max_total_tokens=48_000)
    assert spec.num_pages == 3000 and spec.max_concurrent(1000) == 47
    assert "3000 pages of 16 tokens = 48000 tokens" in spec.kv_cache_summary()
    assert "at once 1 sequences of max_len=40960 or 46 of 1024 tokens" in spec.kv_cache_summary()
    with pytest.raises(ConfigError, match="^--max-total-tokens=40000 .*max_len=40960"):
        qwen3_30b(max_total_tokens=40_000)  # the cap is named, not the memory it caps


def test_page_count_rounds_up_and_a_bad_page_size_is_refused():
    assert [pages_for(n, 16) for n in (1, 16, 17, 1000)] == [1, 1, 2, 63]
    with pytest.raises(ConfigError, match="--page-size=0"):
        qwen3_30b(page_size=0)


def test_a_checked_spec_cannot_change_into_one_its_budget_refuses():
    spec = qwen3_30b(max_total_tokens=48_000)  # holds one sequence of max_len
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_len = 10 * 40960
    with pytest.raises(ConfigError, match="holds no sequence"):  # a changed spec is checked
        dataclasses.replace(spec, max_len=10 * 40960)


def test_cpu_default_is_a_share_of_free_memory_over_the_ranks():
    assert cpu_kv_bytes(4, free=10 * 2**30) == int(10 * 2**30 * CPU_FREE_RAM_SHARE) // 4
    assert cpu_kv_bytes(1) > 0


def test_gpu_budget_is_the_fraction_less_the_weights():
    assert gpu_kv_bytes(80 * 2**30, 0.9, 60 * 2**30) == int(80 * 2**30 * 0.9) - 60 * 2**30
    assert gpu_kv_bytes(80 * 2**30, 0.5, 60 * 2**30) == 0
    with pytest.raises(ValueError, match="mem_fraction_static"):
        gpu_kv_bytes(2**30, 1.5, 0)
    cfg = ModelConfig.from_hf(QWEN3_30B)
    whole = weight_bytes(cfg, ParallelConfig(), "bfloat16")
    assert 56 * 2**30 < whole < 58 * 2**30  # 30.5 B parameters in bf16, from the op sizes
    assert whole / 2 < weight_bytes(cfg, ParallelConfig(ep=2), "bfloat16") < whole * 0.55


def _request(i: int, prompt: int, new: int) -> Request:
    return Request(i, [1] * prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))


def _decode_reply(step) -> StepReply:
    """Every scheduled sequence of the one group samples token 2."""
    n = len(step.scheduled[0])
    return StepReply([GroupReply([2] * n, [None] * n, [None] * n, [[]] * n)], [None])


def test_the_scheduler_admits_160_sequences_of_1000_tokens_of_qwen3_30b_in_16_gib():
    spec = qwen3_30b()
    sched = Scheduler(1, spec.num_slots, spec.max_len, 10**6, None, "round_robin",
                      None, spec.pool_pages, spec.page_size)  # fmt: skip
    for i in range(256):
        sched.add(_request(i, 1000, 1))
    sched.schedule()
    assert len(sched.running[0]) == 173 >= 160  # 63 pages each of 10,922
    assert len(sched.waiting) == 256 - 173


def test_pages_come_back_when_a_sequence_finishes_and_the_rank_is_told():
    sched = Scheduler(1, 8, 64, 1024, None, "round_robin", None, 8, 16)
    for i in range(3):
        sched.add(_request(i, 20, 4))  # 24 tokens: 2 pages each
    step = sched.schedule()
    assert [r.request_id for r in sched.running[0]] == [0, 1, 2] and step.pages[0].released == []
    sched.add(_request(3, 40, 4))  # 3 pages: 2 are free
    for _ in range(4):  # the prefill's token, then three decodes: max_new_tokens reached
        sched.update(step, _decode_reply(step))
        step = sched.schedule()
    assert [r.request_id for r in sched.running[0]] == [3]  # admitted once pages came back
    assert sorted(step.pages[0].released) == [0, 1, 2]  # the rank frees those slots' pages first
    assert sched.pages[0].free == 8 - 3


def test_a_request_that_could_never_fit_is_refused_with_its_numbers():
    sched = Scheduler(1, 8, 64, 1024, None, "round_robin", None, 3, 16)
    with pytest.raises(ValueError, match="may reach 60 tokens, 4 KV pages of 16, .* holds 3"):
        sched.add(_request(0, 50, 10))


def test_a_decode_that_would_overflow_preempts_the_newest_sequence_by_recompute():
    sched = Scheduler(1, 8, 64, 1024, None, "round_robin", None, 4, 4)
    for i in range(2):
        sched.add(_request(i, 8, 8))  # 2 pages each at admission, 4 at their longest
    step = sched.schedule()
    assert len(sched.running[0]) == 2 and sched.pages[0].free == 0
    sched.update(step, _decode_reply(step))  # both sampled their first token
    step = sched.schedule()  # position 8 needs a third page each: request 1 makes room
    assert sched.preemptions == 1 and [r.request_id for r in sched.running[0]] == [0]
    victim = sched.waiting[0]
    assert (victim.request_id, victim.num_computed, victim.slot) == (1, 0, -1)
    assert step.pages[0].released == [1] and step.scheduled[0][0][1] == 1
    first = sched.running[0][0]
    while first.finish_reason is None:  # request 0 runs to its end alone
        sched.update(step, _decode_reply(step))
        step = sched.schedule()
    recompute = step.scheduled[0]  # request 1 back: prompt and output fed again, no draw
    assert recompute[0][1] == 8 and not step.samples()[0][0].draw
    sched.update(step, _decode_reply(step))
    assert sched.running[0][0].output_ids == [2]  # no token came from the recompute
    step = sched.schedule()
    assert step.scheduled[0][0][1] == 1 and step.samples()[0][0].draw


def test_recurrent_states_that_fill_the_budget_are_named():
    """A hybrid model's per-sequence states come out of the budget first; when they take all
    of it the error says so, not a negative page count."""
    cfg = ModelConfig.from_hf("configs/qwen3_5-moe-tiny.json")
    with pytest.raises(ConfigError, match=r"recurrent states of --max-num-seqs=256 .*0\.15 MiB"):
        EngineSpec(cfg, max_len=128, kv_cache_bytes=153_600, max_num_seqs=256)
    assert EngineSpec(cfg, max_len=128, kv_cache_bytes=400_000, max_num_seqs=2).num_pages >= 8


def test_the_mtp_drafters_rows_past_a_sequence_count_in_what_the_pages_hold():
    """With 3 MTP drafts a sequence of 1024 tokens (64 whole pages) writes 2 positions past
    its end: 65 pages, as the scheduler holds them; each token holds the MTP layers' bytes."""
    cfg = ModelConfig.from_hf("configs/deepseek-v3-tiny.json")
    layers, drafters = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    plain = EngineSpec(cfg, max_len=4096, kv_cache_bytes=2**26, dtype="bfloat16")
    mtp = dataclasses.replace(plain, mtp_steps=3)
    assert drafters and mtp.token_bytes * layers == plain.token_bytes * (layers + drafters)
    assert mtp.max_concurrent(1024) == mtp.num_pages // 65 < mtp.num_pages // 64
    assert plain.max_concurrent(1024) == min(plain.max_num_seqs, plain.num_pages // 64)
