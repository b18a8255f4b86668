"""vLLM's penalties and biases, applied on the ranks: each gives the tokens that a plain loop over
the full logits with the same rule gives, in one process and on two ranks with TBO."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.engine.request import InvalidRequestError
from tests.helpers import KW, TINY

PROMPT = [3, 9, 3, 14, 15, 9, 2, 6]
N = 6
EOS = 5
CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "logit_bias": dict(logit_bias={7: 100.0, 11: -100.0}),
    "min_tokens": dict(min_tokens=4),
    "together": dict(frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={4: 3.0}),
}


def _adjusted(row: torch.Tensor, out: list[int], kw: dict) -> torch.Tensor:
    """The rules written as plainly as possible, token by token."""
    row = row.clone()
    if len(out) < kw.get("min_tokens", 0):
        row[EOS] = float("-inf")
    for token, bias in kw.get("logit_bias", {}).items():
        row[token] += bias
    rep = kw.get("repetition_penalty", 1.0)
    for token in set(PROMPT + out):
        row[token] = row[token] / rep if row[token] > 0 else row[token] * rep
    for token in set(out):
        row[token] -= kw.get("frequency_penalty", 0.0) * out.count(token)
        row[token] -= kw.get("presence_penalty", 0.0)
    return row


@pytest.fixture(scope="module")
def engines():
    cfg = ModelConfig(**{**TINY["qwen3_moe"], "eos_token_id": EOS})
    with LLM(config=cfg, **KW) as one, LLM(config=cfg, ep=2, overlap="tbo", **KW) as ep2:
        yield one, ep2


def _reference(llm: LLM, kw: dict) -> list[int]:
    out: list[int] = []
    for _ in range(N):
        params = SamplingParams(temperature=0, max_new_tokens=1)
        logits = llm.generate([PROMPT + out], params, return_logits=True)[0].prompt_logits[-1]
        out.append(int(_adjusted(logits.float(), out, kw).argmax()))
    return out


@pytest.mark.parametrize("case", CASES)
def test_each_adjustment_gives_the_plain_rules_tokens(engines, case):
    one, ep2 = engines
    kw = CASES[case]
    params = SamplingParams(temperature=0, max_new_tokens=N, ignore_eos=True, **kw)
    want = _reference(one, kw)
    plain = one.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=N))[0]
    assert one.generate([PROMPT], params)[0].token_ids == want
    assert ep2.generate([PROMPT], params)[0].token_ids == want
    assert want != plain.token_ids[:N] or case == "min_tokens"  # the rule changed the output


def test_min_tokens_holds_back_eos(engines):
    one, _ = engines
    logit_bias = {EOS: 100.0}  # EOS is every step's likeliest token
    first = one.generate([PROMPT], SamplingParams(temperature=0, logit_bias=logit_bias))[0]
    assert first.token_ids == [EOS] and first.finish_reason == "eos"
    held = SamplingParams(temperature=0, max_new_tokens=8, logit_bias=logit_bias, min_tokens=3)
    out = one.generate([PROMPT], held)[0]
    assert EOS not in out.token_ids[:3] and out.token_ids[3] == EOS and len(out.token_ids) == 4


def test_logprobs_are_of_the_raw_logits_not_the_penalised(engines):
    one, _ = engines
    kw = dict(temperature=0, max_new_tokens=3, ignore_eos=True, logprobs=0)
    raw = one.generate([PROMPT], SamplingParams(**kw))[0]
    biased = one.generate([PROMPT], SamplingParams(**kw, logit_bias={7: 100.0}))[0]
    assert biased.token_ids == [7, 7, 7]
    logits = one.generate([PROMPT], SamplingParams(temperature=0, max_new_tokens=1), True)[0]
    expect = float(torch.log_softmax(logits.prompt_logits[-1].float(), -1)[7])
    assert biased.logprobs[0].logprob == pytest.approx(expect, abs=1e-4)
    assert biased.logprobs[0].rank > 1 or raw.token_ids[0] == 7


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty=nan must be a finite number"),
        (dict(repetition_penalty=0), "repetition_penalty=0 must be > 0"),
        (dict(min_tokens=20), "min_tokens=20 must be at most max_new_tokens=16"),
        (dict(logit_bias={"7": 1.0}), "logit_bias='7' must be an integer >= 0"),
        (dict(logit_bias=[7]), "logit_bias=.* must map token ids to biases"),
    ],
)
def test_bad_adjustments_are_refused_by_name(kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kw)


def test_token_ids_outside_the_vocabulary_are_refused_offline_too(engines):
    one, _ = engines
    with pytest.raises(InvalidRequestError, match="logit_bias holds token id 9999, outside"):
        one.generate([PROMPT], SamplingParams(logit_bias={9999: 1.0}))
    stop = SamplingParams(stop_token_ids=[9999], min_tokens=2)  # an IndexError on the rank once
    with pytest.raises(InvalidRequestError, match="stop_token_ids holds token id 9999, outside"):
        one.generate([PROMPT], stop)


SAMPLED = dict(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=11)


def test_n_returns_the_candidates_each_seeded_as_its_own_request(engines):
    one, _ = engines
    out = one.generate([PROMPT], SamplingParams(n=3, **SAMPLED))[0]
    alone = [
        one.generate([PROMPT], SamplingParams(**{**SAMPLED, "seed": 11 + k}))[0].token_ids
        for k in range(3)
    ]
    assert [o.token_ids for o in out.outputs] == alone and out.token_ids == alone[0]
    assert len({tuple(a) for a in alone}) > 1  # the seeds differ, so do the samples


def test_best_of_returns_the_n_likeliest_candidates(engines):
    one, _ = engines
    out = one.generate([PROMPT], SamplingParams(n=2, best_of=4, **SAMPLED))[0]
    scored = [
        one.generate([PROMPT], SamplingParams(**{**SAMPLED, "seed": 11 + k}, logprobs=0))[0]
        for k in range(4)
    ]
    best = sorted(scored, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert out.logprobs is None and out.outputs[1].logprobs is None  # not asked


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(n=0), "n=0 must be an integer >= 1"),
        (dict(n=3, best_of=2), "best_of=2 must be an integer >= n=3"),
        (dict(best_of=65), "best_of=65 .* must be at most 64"),
    ],
)
def test_bad_n_or_best_of_is_refused(engines, kw, message):
    with pytest.raises(InvalidRequestError, match=message):
        engines[0].generate([PROMPT], SamplingParams(**kw))
