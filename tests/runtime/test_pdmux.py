"""PD multiplexing: split prefill in layer ranges beside the decode steps, on a lane of its own,
exact against a run without it (one process and gloo ranks), with SGLang's refusals."""

from __future__ import annotations

import pytest

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.step import GroupReply, StepReply
from moe_overlap.engine.pdmux import PrefillWaves, layer_ranges
from moe_overlap.engine.request import Request, SamplingParams
from moe_overlap.engine.scheduler import Scheduler
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, reference


@pytest.mark.parametrize(
    ("layers", "splits", "sizes"),
    [(4, 2, [2, 2]), (3, 2, [1, 2]), (61, 4, [15, 15, 15, 16]), (2, 5, [1, 1])],
)
def test_layer_ranges_cover_every_layer_once(layers, splits, sizes):
    ranges = layer_ranges(layers, splits)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))


def _request(i: int, n: int) -> Request:
    return Request(i, list(range(1, n + 1)), SamplingParams(temperature=0, max_new_tokens=3))


def _reply(wave_token: int | None = None) -> StepReply:
    """An idle decode group's reply, and after a wave's last range its one token."""
    wave = None if wave_token is None else [GroupReply([wave_token], [None], [None], [[]])]
    return StepReply([GroupReply()], [None], wave)


def _pdmux_scheduler(budget: int = 64) -> Scheduler:
    return Scheduler(1, 4, 128, budget, pdmux=PrefillWaves(4, 2, budget))


def test_a_wave_runs_beside_the_decodes_one_range_per_step():
    sched = _pdmux_scheduler()
    sched.add(_request(0, 5))
    first = sched.schedule()  # a wave starts: layers 0-1 of the prompt, no decode yet
    assert first.prefill.layers == range(0, 2) and not first.prefill.last
    assert first.batches[0].num_tokens == 0
    sched.update(first, _reply())
    second = sched.schedule()
    assert second.prefill.layers == range(2, 4) and second.prefill.last
    sched.update(second, _reply(wave_token=7))  # the first token
    sched.add(_request(1, 40))
    third = sched.schedule()  # request 0 decodes while request 1's wave starts
    assert third.batches[0].num_tokens == 1 and third.prefill.batches[0].num_tokens == 40


def test_waves_take_whole_prompts_within_the_budget():
    sched = _pdmux_scheduler(budget=50)
    for i, n in enumerate([30, 30, 10]):
        sched.add(_request(i, n))
    step = sched.schedule()
    assert step.prefill.batches[0].extend_lens == [30, 10]  # the second 30 waits


def test_an_aborted_wave_member_keeps_its_slot_until_the_wave_ends():
    sched = _pdmux_scheduler()
    req = _request(0, 5)
    sched.add(req)
    step = sched.schedule()
    sched.abort([req])
    assert len(sched.slots[0]) == 3  # still written by the wave's next range
    sched.update(step, _reply())
    last = sched.schedule()
    sched.update(last, _reply(wave_token=7))
    assert len(sched.slots[0]) == 4 and not req.output_ids


def _drive(sched: Scheduler, steps: int) -> None:
    """``steps`` steps, each decode answered with token 5 and a wave's last range with 7."""
    for _ in range(steps):
        step = sched.schedule()
        n = step.batches[0].num_seqs
        wave = (
            [GroupReply([7], [None], [None], [[]])] if step.prefill and step.prefill.last else None
        )
        sched.update(
            step, StepReply([GroupReply([5] * n, [None] * n, [None] * n, [[]] * n)], [None], wave)
        )


def test_an_aborted_wave_member_gives_back_its_own_pages_and_its_hit():
    """A member that hit the prefix cache, aborted mid-wave: when the wave ends its own pages
    go back (not its cached ones as well) and its hold on the cached pages is let go."""
    sched = Scheduler(1, 4, 64, 64, pdmux=PrefillWaves(4, 2, 64), num_pages=32, page_size=4,
                      prefix_caching=True)  # fmt: skip
    sched.add(_request(0, 12))
    _drive(sched, 5)  # its wave, then decodes to the end: 3 full pages cached
    assert not sched.has_work()
    cache, free = sched.prefix[0], sched.pages[0].free
    idle = len(cache.idle)
    hit = _request(1, 14)  # the same 12 tokens, then 2 more
    sched.add(hit)
    step = sched.schedule()
    assert len(hit.cached) == 3 and len(cache.idle) == idle - 3  # held by the wave
    sched.abort([hit])
    sched.update(step, _reply())
    _drive(sched, 1)  # the wave's last range
    assert not sched.has_work() and not hit.output_ids
    assert sched.pages[0].free == free and len(cache.idle) == idle
    assert len(sched.slots[0]) == 4


@pytest.mark.parametrize(("family", "layout"), [("qwen3_moe", {}), ("deepseek_v3", {"ep": 2})])
def test_pdmux_matches_a_run_without_it(family, layout):
    cfg = ModelConfig(**TINY[family])
    base = reference(cfg)
    with LLM(config=cfg, enable_pdmux=True, pdmux_prefill_splits=2, **layout, **KW) as llm:
        for case, prompts in CASES.items():
            assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


REFUSALS = [
    (dict(pp=2), "--enable-pdmux does not combine with --pp"),
    (dict(ep=2, overlap="tbo"), "--enable-pdmux does not combine with overlap tbo"),
    (dict(tp=2), "--enable-pdmux needs attention TP 1, not 2"),
    (dict(pdmux_prefill_splits=0), "--pdmux-prefill-splits=0 must be an integer >= 1"),
]


@pytest.mark.parametrize(("kw", "message"), REFUSALS)
def test_pdmux_refusals_name_the_flags(kw, message):
    with pytest.raises(ConfigError, match=message):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), enable_pdmux=True, **kw)


def test_a_waves_first_token_is_reported_by_step():
    """The token sampled from a wave's last range reaches ``LLM.step``'s callers (the server's
    streams) like any other, and a one-token request finishes there."""
    cfg = ModelConfig(**TINY["qwen3_moe"])
    one = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
    with LLM(config=cfg, **KW) as llm:
        expected = llm.generate([[4, 5, 6]], one)[0].token_ids
    with LLM(config=cfg, enable_pdmux=True, pdmux_prefill_splits=2, **KW) as llm:
        assert llm.generate([[4, 5, 6]], one)[0].token_ids == expected
        req = llm.make_request("prompt", [4, 5, 6], SamplingParams(temperature=0, max_new_tokens=3))
        llm.scheduler.add(req)
        got = [llm.step() for _ in range(2)]  # the wave's two ranges
        assert got == [[], [req]] and len(req.output_ids) == 1
