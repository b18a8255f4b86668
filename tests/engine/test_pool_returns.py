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
