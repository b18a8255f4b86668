"""Sampling on the ranks: token ids and log-probabilities come back instead of logits, equal to
what the full logits say, and a seeded draw is the same in one process and across ranks."""

from __future__ import annotations

import pickle

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.step import SampleSpec, StepReply
from moe_overlap.engine.request import InvalidRequestError
from moe_overlap.runtime.sampler import answer
from tests.helpers import KW, TINY

CFG = TINY["qwen3_moe"]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(10, 40))]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, seed=5, ignore_eos=True)
SCORE = SamplingParams(max_new_tokens=0, prompt_logprobs=2)  # what lm-eval's scoring sends


@pytest.fixture(scope="module")
def outputs():
    """The same requests in one process and on two expert-parallel ranks with TBO."""
    cfg = ModelConfig(**CFG)
    got = {}
    for name, layout in {"one": {}, "ep2": dict(ep=2, overlap="tbo")}.items():
        with LLM(config=cfg, **layout, **KW) as llm:
            got[name] = (llm.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, SEEDED))
            got[name + " reply"] = llm.last_reply
            got[name + " score"] = llm.generate(PROMPTS, SCORE)
    with LLM(config=cfg, **KW) as llm:  # every position's logits, from one forward each
        got["logits"] = [
            llm.generate(
                [p + o.token_ids[:-1]], SamplingParams(max_new_tokens=1, temperature=0), True
            )[0]
            for p, o in zip(PROMPTS, got["one"][0], strict=True)
        ]
    return got


def test_logprobs_are_the_log_softmax_of_the_full_logits(outputs):
    for prompt, out, full in zip(PROMPTS, outputs["one"][0], outputs["logits"], strict=True):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, lp in enumerate(out.logprobs):
            row = torch.log_softmax(full.prompt_logits[len(prompt) - 1 + j].float(), -1)
            assert lp.token_id == out.token_ids[j] == int(row.argmax())  # greedy
            assert abs(lp.logprob - float(row[lp.token_id])) <= 1e-4
            assert lp.rank == 1
            values, ids = torch.topk(row, 3)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert max(abs(v - float(w)) for (_, v), w in zip(lp.top, values, strict=True)) < 1e-4
        assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_tokens_and_logprobs_are_the_same_across_ranks(outputs):
    (greedy_one, seeded_one), (greedy_ep, seeded_ep) = outputs["one"], outputs["ep2"]
    for a, b in zip(greedy_one, greedy_ep, strict=True):
        assert a.token_ids == b.token_ids
        assert all(
            abs(x.logprob - y.logprob) <= 1e-4 for x, y in zip(a.logprobs, b.logprobs, strict=True)
        )
    assert [o.token_ids for o in seeded_one] == [o.token_ids for o in seeded_ep]
    assert seeded_one[0].logprobs is None  # not asked


@pytest.mark.parametrize("layout", ["one", "ep2"])
def test_prompt_logprobs_score_every_prompt_token_across_chunks(outputs, layout):
    """The 30-token prompt is prefilled in chunks of at most 24 tokens: the last row of a chunk
    scores the first token of the next."""
    for prompt, out, full in zip(
        PROMPTS, outputs[layout + " score"], outputs["logits"], strict=True
    ):
        assert out.token_ids == [] and out.finish_reason == "length"
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for j, lp in enumerate(out.prompt_logprobs[1:]):
            row = torch.log_softmax(full.prompt_logits[j].float(), -1)
            assert lp.token_id == prompt[j + 1]
            assert abs(lp.logprob - float(row[prompt[j + 1]])) <= 1e-4
            assert lp.rank == int((row > row[prompt[j + 1]]).sum()) + 1
            assert [t for t, _ in lp.top] == torch.topk(row, 2).indices.tolist()


def test_a_seeded_draw_depends_on_the_seed_not_the_batch():
    cfg = ModelConfig(**CFG)
    with LLM(config=cfg, **KW) as llm:
        alone = llm.generate(PROMPTS[:1], SEEDED)[0].token_ids
        batched = llm.generate(PROMPTS, SEEDED)[0].token_ids
        other = llm.generate(PROMPTS[:1], SamplingParams(**{**vars(SEEDED), "seed": 6}))
    assert alone == batched
    assert other[0].token_ids != alone  # 6 tokens at temperature 0.9: another seed differs


def test_a_decode_step_sends_token_ids_not_logits(outputs):
    reply: StepReply = outputs["ep2 reply"]
    assert all(g.logits is None for g in reply.groups)
    assert all(t is not None for g in reply.groups for t in g.token_ids)


def test_reply_size_for_a_64_sequence_decode_step():
    """Against the logits it replaces: 64 x 151936 fp32 (Qwen3's vocabulary) is 38.9 MB."""
    from moe_overlap.core.batch import ForwardBatch

    vocab, n = 151936, 64
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long), list(range(n)), [9] * n, [1] * n)
    logits = torch.randn(n, vocab)
    reply = answer(batch, logits, [SampleSpec()] * n, "none")
    size = len(pickle.dumps(reply))
    assert size < 4096 < logits.numel() * 4  # token ids only: bytes, not megabytes


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", 21, "logprobs=21 must be at most 20"),
        ("logprobs", -1, "logprobs=-1 must be an integer >= 0"),
        ("logprobs", 2.0, "logprobs=2.0 must be an integer >= 0"),
        ("prompt_logprobs", 21, "prompt_logprobs=21 must be at most 20"),
        (
            "max_new_tokens",
            0,
            r"max_new_tokens=0 must be an integer >= 1 \(0 needs prompt_logprobs",
        ),
    ],
)
def test_bad_logprobs_are_refused_by_name(field, value, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value})
