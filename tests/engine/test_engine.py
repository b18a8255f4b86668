"""The one-process engine: chunked prefill, continuous batching, sampling and bad input."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, InvalidRequestError, ModelConfig, SamplingParams
from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import SampleSpec
from moe_overlap.runtime import sampler as sampler_module
from moe_overlap.runtime.draws import probabilities
from moe_overlap.runtime.sampler import sample
from tests.helpers import TINY

PROMPTS = [[1, 5, 9, 13, 2, 8, 30, 31, 40, 41, 7, 3, 60], [4, 4, 2], [9] * 21, [70, 12]]


@pytest.fixture(params=sorted(TINY))
def config(request):
    return ModelConfig(**TINY[request.param])


def run(config, prompts=PROMPTS, params=None, **kw):
    with LLM(config=config, seed=0, **kw) as llm:
        return llm.generate(
            prompts,
            params or SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True),
            return_logits=True,
        )


def test_chunked_prefill_equals_single_prefill(config):
    whole = run(config)
    for budget in (1, 3, 7):
        chunked = run(config, max_num_batched_tokens=budget)
        for a, b in zip(whole, chunked, strict=True):
            assert torch.allclose(a.prompt_logits, b.prompt_logits, atol=1e-5, rtol=0)
            assert a.token_ids == b.token_ids


def test_batched_decode_equals_one_by_one(config):
    batched = run(config)
    for prompt, out in zip(PROMPTS, batched, strict=True):
        alone = run(config, [prompt])[0]
        assert alone.token_ids == out.token_ids
        assert torch.allclose(alone.prompt_logits, out.prompt_logits, atol=1e-5, rtol=0)


def test_continuous_batching_with_few_slots_gives_same_tokens(config):
    # two slots for four requests: later ones join as earlier ones finish
    assert [o.token_ids for o in run(config, max_num_seqs=2)] == [o.token_ids for o in run(config)]


def test_sampling_is_seeded_and_respects_top_k(config):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=3, seed=7, ignore_eos=True)
    a, b = run(config, params=params), run(config, params=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    greedy = run(config, params=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    top1 = SamplingParams(max_new_tokens=8, temperature=2.0, top_k=1, seed=3, ignore_eos=True)
    assert [o.token_ids for o in run(config, params=top1)] == [o.token_ids for o in greedy]
    tiny_p = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert [o.token_ids for o in run(config, params=tiny_p)] == [o.token_ids for o in greedy]


def test_tiny_temperatures_are_greedy_and_tiny_top_p_keeps_the_likeliest_token():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    greedy = int(torch.argmax(logits))
    for params in (
        SamplingParams(temperature=1e-39),  # once made the engine thread raise
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=1.0, top_p=1e-300),  # rounds to 0 in float32
    ):
        specs = [SampleSpec(params.temperature, params.top_p, seed=s) for s in range(20)]
        assert [sample(logits, spec) for spec in specs] == [greedy] * 20
    assert SamplingParams(temperature=1e-39).temperature == 0.0


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_likeliest():
    """vLLM's min-p: after temperature, a token less likely than min_p x the likeliest is never
    drawn; the rest keep their relative odds."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probabilities(logits, SampleSpec(1.0, min_p=0.2))  # floor: 0.2 x 0.5 = 0.1
    assert probs[3] == 0 and probs[:3].gt(0).all()
    assert torch.allclose(probs[:3] / probs[:3].sum(), torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    draws = {sample(logits, SampleSpec(1.0, seed=s, min_p=0.2)) for s in range(200)}
    assert draws == {0, 1, 2}
    assert {sample(logits, SampleSpec(1.0, seed=s, min_p=1.0)) for s in range(50)} == {0}


def test_a_request_that_fails_in_a_step_fails_alone(monkeypatch):
    def flaky(logits, spec):
        if spec.seed == 13:
            raise RuntimeError("injected sampling fault")
        return sample(logits, spec)

    monkeypatch.setattr(sampler_module, "sample", flaky)
    config = ModelConfig(**TINY["qwen3_moe"])
    good = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    bad = SamplingParams(max_new_tokens=5, ignore_eos=True, seed=13, temperature=1.0)
    with LLM(config=config, seed=0, max_num_seqs=2) as llm:
        outs = llm.generate(PROMPTS[:3], [good, bad, good])
        again = llm.generate(PROMPTS[:3], good)  # the engine and its slots are intact
    assert outs[1].finish_reason == "error" and "injected sampling fault" in outs[1].error
    assert outs[1].token_ids == []
    assert [outs[0].token_ids, outs[2].token_ids] == [again[0].token_ids, again[2].token_ids]
    assert all(len(o.token_ids) == 5 and o.error is None for o in again)


def test_stops_on_eos_and_context():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    first = run(cfg, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))[
        0
    ].token_ids
    cfg.eos_token_id = first[1]
    out = run(cfg, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4))[0]
    assert out.token_ids == first[:2] and out.finish_reason == "eos"
    out = run(
        cfg,
        [[1, 2, 3]],
        SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True),
        max_model_len=8,
    )[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "context"


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "prompt 1 is empty"),
        ([1, 80], r"token ids \[80\] outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([1] * 65, "longer than the model's context of 64"),
    ],
)
def test_bad_prompt_is_refused_and_engine_stays_usable(prompt, match):
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with LLM(config=cfg, seed=0) as llm:
        good = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=3))
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([[1, 2, 3], prompt], SamplingParams(temperature=0, max_new_tokens=3))
        assert not llm.scheduler.has_work()
        assert (
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=3))[0].token_ids
            == good[0].token_ids
        )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": -1}, "temperature=-1"),
        ({"top_p": 0}, "top_p=0"),
        ({"top_k": -2}, "top_k=-2"),
        ({"min_p": 1.5}, "min_p=1.5 must be in \\[0, 1\\]"),
        ({"min_p": -0.1}, "min_p=-0.1"),
    ],
)
def test_bad_sampling_params(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "disabled", as the server takes it


def test_prompts_of_one_length_attend_in_one_group_and_equal_one_by_one(config):
    # three 8-token prompts share one attention call per layer (and, chunked by 6, groups of
    # equal prefix), around a 2-token one that attends on its own
    prompts = [list(range(1, 9)), [3] * 8, [4, 5], list(range(20, 28))]
    for budget in (None, 6):
        kw = {} if budget is None else {"max_num_batched_tokens": budget}
        together = run(config, prompts, **kw)
        for prompt, out in zip(prompts, together, strict=True):
            alone = run(config, [prompt])[0]
            assert alone.token_ids == out.token_ids
            assert torch.allclose(alone.prompt_logits, out.prompt_logits, atol=1e-5, rtol=0)


def test_attention_plan_groups_extends_by_prefix_and_length():
    # sequences: fresh 3, decode, fresh 3, 2 after a prefix of 4, fresh 2
    batch = ForwardBatch(
        torch.zeros(11, dtype=torch.long),
        slots=[5, 1, 6, 2, 9],
        prefix_lens=[0, 7, 0, 4, 0],
        extend_lens=[3, 1, 3, 2, 2],
        is_decode=[False, True, False, False, False],
    )
    plan = AttentionPlan.of(batch)
    groups = {(g.prefix, g.new): g for g in plan.extends}
    assert sorted(groups) == [(0, 2), (0, 3), (4, 2)]
    fresh3 = groups[(0, 3)]
    assert fresh3.slots == slice(5, 7) and fresh3.rows.tolist() == [0, 1, 2, 4, 5, 6]
    assert groups[(4, 2)].rows == slice(7, 9) and groups[(4, 2)].slots == slice(2, 3)
    assert plan.decode_rows.tolist() == [3] and plan.decode_max_len == 8
    assert plan.decode_lens is None  # one decode length: no mask
    assert not plan.all_decode


def test_a_closed_one_process_engine_refuses_to_generate_as_a_spawned_one_does():
    from moe_overlap.runtime.spawn import RankFailure

    llm = LLM(config=ModelConfig(**TINY["qwen3_moe"]), seed=0)
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(RankFailure, match="the engine was stopped"):
        llm.generate([[1, 2]], SamplingParams(max_new_tokens=2))
