"""vLLM's ``return_token_ids`` over HTTP, against a server on two expert-parallel ranks with TBO:
``prompt_token_ids`` where vLLM puts them (on each completion choice, on a chat response;
streamed, on the first chunk of each choice) and each choice's ``token_ids`` (streamed, each
chunk its delta's). The prompt's ids are checked against the tokenizer's encoding of the prompt
(a chat's: of its template rendered), the generated ids against the text they decode to."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from moe_overlap import LLM, SamplingParams
from tests.server.test_server import KEY, served_model, two_rank_server

PROMPTS = ["Question 3: where is the river?", "The fox"]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is the river?"},
]
NEW = 5  # tokens per choice (ignore_eos: exactly that many)
SAMPLED = {"max_tokens": NEW, "ignore_eos": True, "temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory, "token_ids")


@pytest.fixture(scope="module")
def served(model_dir):
    yield from two_rank_server(model_dir)


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model_dir) as llm:
        yield llm


def _post(served, path: str, body: dict) -> Any:
    """The JSON answer (streamed: its chunks) of ``body`` posted to ``path``."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", path, body=json.dumps({"model": "tiny", **body}), headers=headers)
    reply = conn.getresponse()
    text = reply.read().decode()
    assert reply.status == 200, text
    if not body.get("stream"):
        return json.loads(text)
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _decode(offline: LLM, ids: list[int]) -> str:
    return offline.tokenizer.decode(ids, skip_special_tokens=True)


def _chat_prompt_ids(offline: LLM) -> list[int]:
    tok = offline.tokenizer
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _per_choice(chunks: list[dict], chat: bool) -> dict[int, dict]:
    """Per streamed choice: the prompt ids each of its chunks carried (None where one carried
    none; a chat's on the response), its token ids and its text, concatenated."""
    seen: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            got = seen.setdefault(c["index"], {"prompt": [], "ids": [], "text": ""})
            got["prompt"].append((chunk if chat else c).get("prompt_token_ids"))
            got["ids"] += c["token_ids"]
            got["text"] += (c["delta"].get("content") or "") if chat else c["text"]
    return seen


def test_each_completion_choice_carries_its_prompt_ids_and_its_own(served, offline):
    """Two prompts, n=2: each choice's prompt ids are its prompt's encoding, and its own ids
    decode to its text; greedy, they are the offline engine's tokens."""
    reply = _post(
        served, "/v1/completions", {"prompt": PROMPTS, "n": 2, "return_token_ids": True} | SAMPLED
    )
    assert len(reply["choices"]) == 4 and "prompt_token_ids" not in reply
    for c in reply["choices"]:
        assert c["prompt_token_ids"] == offline.tokenizer.encode(PROMPTS[c["index"] // 2])
        assert len(c["token_ids"]) == NEW and _decode(offline, c["token_ids"]) == c["text"]
    assert reply["choices"][0]["token_ids"] != reply["choices"][1]["token_ids"]  # seed, seed + 1
    greedy = _post(
        served,
        "/v1/completions",
        {"prompt": PROMPTS[0], "return_token_ids": True} | SAMPLED | {"temperature": 0},
    )
    want = offline.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    )[0]
    assert greedy["choices"][0]["prompt_token_ids"] == want.prompt_ids
    assert greedy["choices"][0]["token_ids"] == want.token_ids


def test_best_of_choices_carry_their_own_prompts_ids(served, offline):
    """best_of=2, n=1 over two prompts: the second choice is the second prompt's (its index is
    not a candidate's)."""
    ask = {"prompt": PROMPTS, "best_of": 2, "return_token_ids": True} | SAMPLED
    reply = _post(served, "/v1/completions", ask)
    got = [c["prompt_token_ids"] for c in reply["choices"]]
    assert got == [offline.tokenizer.encode(p) for p in PROMPTS]


def test_a_streamed_completion_sends_prompt_ids_on_each_choices_first_chunk(served, offline):
    ask = {"prompt": PROMPTS, "n": 2, "return_token_ids": True, "stream": True} | SAMPLED
    seen = _per_choice(_post(served, "/v1/completions", ask), chat=False)
    assert sorted(seen) == [0, 1, 2, 3]
    for index, got in seen.items():
        first, *rest = got["prompt"]
        assert first == offline.tokenizer.encode(PROMPTS[index // 2])
        assert rest and rest == [None] * len(rest)
        assert len(got["ids"]) == NEW and _decode(offline, got["ids"]) == got["text"]


def test_a_chat_response_carries_its_templated_prompt_ids(served, offline):
    ask = {"messages": MESSAGES, "n": 2, "return_token_ids": True} | SAMPLED
    reply = _post(served, "/v1/chat/completions", ask)
    assert reply["prompt_token_ids"] == _chat_prompt_ids(offline)
    assert reply["usage"]["prompt_tokens"] == len(reply["prompt_token_ids"])  # once, as vLLM
    for c in reply["choices"]:
        assert "prompt_token_ids" not in c
        assert len(c["token_ids"]) == NEW
        assert _decode(offline, c["token_ids"]) == c["message"]["content"]


def test_a_streamed_chat_sends_prompt_ids_with_each_choices_role_chunk(served, offline):
    """As vLLM: each choice's opening chunk (its role) carries the prompt's ids on the
    response, and no later chunk does; the deltas' ids decode to the content streamed."""
    ask = {"messages": MESSAGES, "n": 2, "return_token_ids": True, "stream": True} | SAMPLED
    chunks = _post(served, "/v1/chat/completions", ask)
    for i in (0, 1):
        assert chunks[i]["choices"][0]["delta"]["role"] == "assistant"
    seen = _per_choice(chunks, chat=True)
    assert sorted(seen) == [0, 1]
    for got in seen.values():
        first, *rest = got["prompt"]
        assert first == _chat_prompt_ids(offline)
        assert rest and rest == [None] * len(rest)
        assert len(got["ids"]) == NEW and _decode(offline, got["ids"]) == got["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_without_return_token_ids_no_prompt_ids_are_sent(served, stream):
    for path, ask in [
        ("/v1/completions", {"prompt": PROMPTS[0]}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        reply = _post(served, path, ask | SAMPLED | {"n": 2, "stream": stream})
        for body in reply if stream else [reply]:
            assert "prompt_token_ids" not in body
            assert all("prompt_token_ids" not in c for c in body["choices"])
            assert all("token_ids" in c for c in body["choices"])  # always, as documented
