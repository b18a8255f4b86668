"""Log-probabilities and echo over HTTP, with the official ``openai`` client against a server on
two expert-parallel ranks with TBO: the values equal the offline engine's, in OpenAI's shapes,
whole and streamed; prompt scoring (``echo`` with ``max_tokens`` 0) is what lm-eval's
log-likelihood requests send."""

from __future__ import annotations

import json

import pytest

from moe_overlap import LLM, SamplingParams
from tests.server.test_server import _metrics, served_model, two_rank_server

PROMPT = "Question 3: where is the river?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory, "logprobs")


@pytest.fixture(scope="module")
def served(model_dir):
    yield from two_rank_server(model_dir, metrics_record_every=1)


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine's tokens and log-probabilities for PROMPT."""
    with LLM(model_dir) as llm:
        ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
        params = SamplingParams(
            temperature=0, max_new_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=2
        )
        yield llm, ids, llm.generate([ids], params)[0]  # open while the module's tests use it


def _text(llm: LLM, token_id: int) -> str:
    return llm.tokenizer.decode([token_id])


def test_completion_logprobs_equal_the_offline_engine(served, offline):
    llm, _, want = offline
    reply = served.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = reply.choices[0].logprobs
    assert reply.choices[0].token_ids == want.token_ids
    assert lp.tokens == [_text(llm, t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    for top, x in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert max(top, key=top.get) == _text(llm, x.top[0][0])
        assert {_text(llm, t) for t, _ in x.top} <= set(top)
    text = reply.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == text


def test_echo_with_max_tokens_0_scores_the_prompt(served, offline):
    llm, ids, want = offline
    reply = served.client().completions.create(
        model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    assert choice.token_ids == [] and choice.text == llm.tokenizer.decode(ids)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offline_scores = [x.logprob for x in want.prompt_logprobs[1:]]
    assert lp.token_logprobs[1:] == pytest.approx(offline_scores, abs=1e-4)
    assert lp.tokens == [_text(llm, t) for t in ids]
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0


def test_echo_puts_the_prompt_before_the_output_whole_and_streamed(served, offline):
    llm, ids, want = offline
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=0)
    kw["extra_body"] = {"ignore_eos": True}
    whole = served.client().completions.create(**kw).choices[0]
    assert whole.text.startswith(PROMPT) and whole.token_ids == want.token_ids
    assert len(whole.logprobs.tokens) == len(ids) + len(want.token_ids)
    chunks = list(served.client().completions.create(stream=True, **kw))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == whole.text
    token_logprobs = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert token_logprobs == whole.logprobs.token_logprobs
    offsets = [v for c in streamed if c.logprobs for v in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


def test_chat_logprobs_and_top_logprobs(served, offline):
    llm = offline[0]
    reply = served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [_text(llm, t) for t in choice.token_ids]
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6
        assert c.bytes == list(c.token.encode())
    streamed = served.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, stream=True,
    )  # fmt: skip
    tokens = [c.token for k in streamed if k.choices and k.choices[0].logprobs
              for c in k.choices[0].logprobs.content]  # fmt: skip
    assert tokens == [c.token for c in content]


def test_penalties_and_logit_bias_pass_through(served, offline):
    llm, ids, _ = offline
    kw = dict(frequency_penalty=1.2, presence_penalty=0.4, logit_bias={9: 5.0}, min_tokens=2)
    want = llm.generate(
        [ids], SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, **kw)
    )[0]
    extra = {"ignore_eos": True, "min_tokens": 2}
    reply = served.client().completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0, frequency_penalty=1.2,
        presence_penalty=0.4, logit_bias={"9": 5.0}, extra_body=extra,
    )  # fmt: skip
    assert reply.choices[0].token_ids == want.token_ids


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "without echo"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "logit_bias key 'x' is not a"),
        (
            {"prompt": "hi", "presence_penalty": 3},
            "presence_penalty",
            "presence_penalty=3.0 must be in [-2, 2]",
        ),
    ],
)
def test_bad_logprob_requests_are_refused_by_name(served, body, param, words):
    code, reply = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert code == 400 and reply["error"]["param"] == param, reply
    assert words in reply["error"]["message"]


def test_n_and_best_of_over_http(served, offline):
    llm, ids, _ = offline
    sampled = dict(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=3)
    want = llm.generate([ids], SamplingParams(n=2, best_of=3, **sampled))[0]
    kw = dict(model="tiny", prompt=ids, max_tokens=5, temperature=1.0, seed=3)
    reply = served.client().completions.create(
        n=2, best_of=3, extra_body={"ignore_eos": True}, **kw
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.token_ids for c in reply.choices] == [o.token_ids for o in want.outputs]
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 10
    whole = served.client().completions.create(n=2, extra_body={"ignore_eos": True}, **kw)
    chunks = served.client().completions.create(
        n=2, stream=True, extra_body={"ignore_eos": True}, **kw
    )
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
    code, body = served.raw(
        "POST", "/v1/completions",
        json.dumps({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}).encode(),
    )  # fmt: skip
    assert code == 400 and body["error"]["param"] == "best_of"


def test_lm_evals_loglikelihood_request_scores_a_continuation(served, offline):
    """The body lm-eval's local-completions sends for log-likelihood (two requests batched):
    it sums ``token_logprobs[ctxlen:-1]`` (the last entry is the generated token). `make eval`
    runs lm-eval itself against a server; this is the same request without installing it."""
    llm, ids, _ = offline
    pairs = [(ids[:4], ids[4:9]), (ids[:2], ids[2:])]
    body = {"model": "tiny", "prompt": [c + x for c, x in pairs], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    code, reply = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert code == 200
    for (ctx, cont), choice in zip(pairs, reply["choices"], strict=True):
        got = sum(choice["logprobs"]["token_logprobs"][len(ctx) : -1])
        scored = llm.generate([ctx + cont], SamplingParams(max_new_tokens=0, prompt_logprobs=0))
        want = sum(lp.logprob for lp in scored[0].prompt_logprobs[len(ctx) :])
        assert got == pytest.approx(want, abs=1e-4)
        tops = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
        assert all(len(top) >= 1 for top in tops)


def test_metrics_count_the_modes_run_and_the_communication_hidden(served):
    before = _metrics(served)
    served.client().completions.create(model="tiny", prompt="a b c d e f", max_tokens=4)
    after = _metrics(served)
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    forwards = {k: v for k, v in grew.items() if k.startswith("moe_overlap_forwards_total")}
    assert sum(forwards.values()) >= 2 * 4  # two data-parallel groups, four steps at least
    assert set(forwards) <= {f"moe_overlap_forwards_total{{{m}}}" for m in ("tbo", "none")}
    comm, hidden = (
        grew["moe_overlap_comm_seconds_total"],
        grew["moe_overlap_comm_hidden_seconds_total"],
    )
    assert comm > 0 and 0 <= hidden <= comm  # every step recorded: two ranks all-to-all
    assert 0 <= after["moe_overlap_comm_hidden_share"] <= 1
