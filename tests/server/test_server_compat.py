"""Against a real one-process server: request shapes OpenAI's API and vLLM's server accept and
answer, which an OpenAI-compatible client may send."""

from __future__ import annotations

import json

import pytest

from moe_overlap import LLM
from tests.server.test_server import KEY, Running, served_model

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run = Running(LLM(served_model(tmp_path_factory, "compat"), max_num_seqs=4), api_key=KEY)
    yield run
    run.stop()
    assert run.error is None


def post(run: Running, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    return run.raw("POST", path, json.dumps(body).encode())


# OpenAI's nullable fields (and vLLM's extensions it declares Optional), null meaning unset
COMMON_NULLS = [
    "frequency_penalty",
    "logit_bias",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
]
NULLS = {
    "/v1/completions": COMMON_NULLS + ["best_of", "echo", "logprobs", "suffix"],
    "/v1/chat/completions": COMMON_NULLS
    + [
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "parallel_tool_calls",
        "response_format",
        "tools",
        "tool_choice",
    ],
}


@pytest.mark.parametrize("path", NULLS)
def test_null_fields_are_their_defaults(served, path):
    """OpenAI's clients send ``null`` for a field they leave unset (``temperature=None``);
    OpenAI and vLLM read it as the default. Each was a 400 here ("temperature: Input should
    be a valid number")."""
    base = {"prompt": "The river"} if path == "/v1/completions" else CHAT
    base = {**base, "max_tokens": 4, "seed": 5}
    code, plain = post(served, base, path)
    assert code == 200, plain
    for name in NULLS[path]:
        body, want = {**base, name: None}, plain
        if name == "seed":  # no seed: the greedy answer is the one to match
            greedy = {k: v for k, v in base.items() if k != "seed"} | {"temperature": 0}
            body, want = {**greedy, "seed": None}, post(served, greedy, path)[1]
        code, reply = post(served, body, path)
        assert code == 200, (name, reply)
        got = [c["token_ids"] for c in reply["choices"]]
        assert got == [c["token_ids"] for c in want["choices"]], name


def test_tokenize_returns_token_strings_when_asked(served):
    """vLLM's ``/tokenize`` takes ``return_token_strs`` (default false) and then answers the
    tokenizer's string of each id in ``token_strs``; it was refused as an unknown field, even
    at false, and ``token_strs`` was always null."""
    code, plain = post(
        served, {"prompt": "where is the fox", "return_token_strs": False}, "/tokenize"
    )
    assert code == 200 and plain["token_strs"] is None, plain
    code, reply = post(
        served, {"prompt": "where is the fox", "return_token_strs": True}, "/tokenize"
    )
    assert code == 200 and reply["tokens"] == plain["tokens"], reply
    tok = served.server.engine.llm.tokenizer
    assert reply["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    assert "".join(reply["token_strs"]) == "where\u0120is\u0120the\u0120fox"  # byte-level spaces


def test_echo_of_max_tokens_0_without_logprobs_returns_none(served):
    """``echo`` with ``max_tokens`` 0 and no ``logprobs`` answers the prompt's text with
    ``logprobs`` null, as vLLM does (OpenAI's: only returned when asked); the prompt's
    log-probabilities the engine computes to run it were returned unasked, whole and streamed."""
    body = {"prompt": ["where is", "the fox"], "max_tokens": 0, "echo": True}
    code, reply = post(served, body)
    assert code == 200, reply
    assert [c["text"] for c in reply["choices"]] == ["where is", "the fox"]
    assert [c["logprobs"] for c in reply["choices"]] == [None, None]
    chunks = served.client().completions.create(model="tiny", stream=True, **body)
    assert [c.logprobs for chunk in chunks for c in chunk.choices] == [None, None]
    asked = post(served, {**body, "logprobs": 0})[1]["choices"][0]["logprobs"]
    assert asked["tokens"] and asked["token_logprobs"][0] is None  # asked: still scored


def test_greedy_tokens_are_the_likeliest_in_top_logprobs(served):
    """``top_logprobs`` is keyed by token strings, and byte-level tokens that are no whole
    UTF-8 (most of a random model's) all read "\\ufffd": the key kept the value of the last
    such alternative, the least likely, so a greedy token could show a value below its own
    and below another key (lm-eval's ``is_greedy`` then says no). A key now holds the most
    likely value of the tokens that read as it."""
    body = {"prompt": "The river", "max_tokens": 24, "temperature": 0, "logprobs": 5}
    lp = post(served, {**body, "ignore_eos": True})[1]["choices"][0]["logprobs"]
    collided = 0
    columns = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    for token, value, top in zip(*columns, strict=True):
        assert top[token] == value == max(top.values()), (token, value, top)
        collided += len(top) < 5
    assert collided, "no two alternatives read the same: the case is not exercised"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
        ("/v1/completions", {"prompt": [5, 999999]}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 1024}, "prompt"),  # the context is 1024
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1023}, "prompt"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1020}, "messages"),
    ],
)
def test_a_prompt_that_cannot_run_is_a_400_naming_it(served, path, body, param):
    """An empty prompt, token ids outside the vocabulary, a prompt past the context or one
    that leaves no room for max_tokens: each named the prompt in the message only, ``param``
    null; OpenAI's context_length_exceeded names ``messages``."""
    code, reply = post(served, body, path)
    assert code == 400 and reply["error"]["param"] == param, reply
