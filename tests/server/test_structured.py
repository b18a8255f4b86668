"""Structured outputs through the server at ep=2 with two-batch overlap, driven by the ``openai``
client: every way OpenAI, vLLM and SGLang ask for one, with n, logprobs, stop and streaming, and
a constraint xgrammar refuses answered 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_overlap import LLM
from tests.server.test_server import Running, served_model
from tests.server.test_server_native import post

SCHEMA = {  # short keys and bounded values, so a random model's output ends soon
    "type": "object",
    "properties": {
        "c": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        # a pattern, not maxLength: xgrammar 0.2.8 lets control characters into a bounded string
        "s": {"type": "string", "pattern": "^[a-z]{1,3}$"},
        "b": {"type": "boolean"},
    },
    "required": ["c", "n", "s", "b"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "Describe a fox as JSON."}]
REGEX = r"[a-c]{2,6}x"


def valid(text: str) -> bool:
    """``text`` parses as JSON and follows SCHEMA (checked by hand: keys in order, types,
    bounds)."""
    value = json.loads(text)
    n = value["n"]
    return (
        list(value) == ["c", "n", "s", "b"]
        and value["c"] in ("red", "green", "blue")
        and isinstance(n, int)
        and not isinstance(n, bool)
        and 0 <= n <= 99
        and isinstance(value["s"], str)
        and re.fullmatch("[a-z]{1,3}", value["s"]) is not None
        and isinstance(value["b"], bool)
    )


def ask_args(seed: int) -> dict:
    return dict(
        model="tiny", messages=CHAT, response_format=RESPONSE_FORMAT, seed=seed, max_tokens=60
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = served_model(tmp_path_factory, "structured")
    # 10 sequences per rank in 80 pages of 4 tokens: twenty requests at once preempt some
    llm = LLM(
        model,
        ep=2,
        overlap="tbo",
        max_num_seqs=10,
        page_size=4,
        max_total_tokens=320,
        max_model_len=160,
    )
    run = Running(llm)
    yield run
    run.stop()
    assert run.error is None


def test_json_schema_outputs_validate_over_twenty_seeded_sampled_requests(served):
    client = served.client()

    def ask(seed: int):
        return client.chat.completions.create(**ask_args(seed), logprobs=seed % 2 == 0).choices[0]

    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(ask, range(20)))
    assert all(c.finish_reason == "stop" and valid(c.message.content) for c in choices)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer
    assert served.server.engine.llm.scheduler.preemptions > 0
    # alone and streamed, a request gives what it gave among twenty with preemptions
    chunks = client.chat.completions.create(**ask_args(7), stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choices[7].message.content
    with_logprobs = choices[0].logprobs
    assert with_logprobs is not None and "".join(t.token for t in with_logprobs.content)
    # n > 1 and completions' logprobs: every choice follows the schema
    reply = client.completions.create(
        model="tiny",
        prompt="A fox:",
        n=3,
        seed=5,
        logprobs=2,
        max_tokens=60,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    assert len(reply.choices) == 3 and all(valid(c.text) for c in reply.choices)
    assert all(len(c.logprobs.tokens) > 0 for c in reply.choices)


def test_regex_choice_and_ebnf_outputs_match(served):
    client = served.client()
    grammar = 'root ::= "(" [1-9] [0-9]? ")"'
    asks = [
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_choice": ["yes", "no", 'a "q"']}, lambda t: t in ("yes", "no", 'a "q"')),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"ebnf": grammar}, lambda t: re.fullmatch(r"\([1-9][0-9]?\)", t)),
        ({"guided_grammar": grammar}, lambda t: re.fullmatch(r"\([1-9][0-9]?\)", t)),
        ({"guided_json": json.dumps(SCHEMA)}, valid),
        ({"json_schema": json.dumps(SCHEMA)}, valid),
    ]

    def ask(case):
        extra, _ = case
        return [
            c.text
            for c in client.completions.create(
                model="tiny", prompt="Answer:", seed=3, max_tokens=60, extra_body=extra
            ).choices
        ]

    with ThreadPoolExecutor(len(asks)) as pool:
        texts = list(pool.map(ask, asks))
    for (extra, matches), got in zip(asks, texts, strict=True):
        assert all(matches(t) for t in got), (extra, got)
    # any JSON object: it starts as one (a random model may run on inside it)
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, response_format={"type": "json_object"}, seed=1, max_tokens=8
    )
    assert reply.choices[0].message.content.startswith("{")
    # a stop string cuts the constrained output: what is left is the regex's prefix
    reply = client.completions.create(
        model="tiny", prompt="Answer:", seed=4, max_tokens=20, stop=["c"], extra_body=asks[0][0]
    )
    assert re.fullmatch(r"[ab]*", reply.choices[0].text.removesuffix("x"))
    code, native = post(
        served,
        "/generate",
        {"text": "Answer:", "sampling_params": {"json_schema": json.dumps(SCHEMA), "n": 1}},
    )
    assert code == 200 and valid(native["text"])


@pytest.mark.parametrize(
    "extra, field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"regex": "a", "guided_choice": ["a"]}, "regex"),
    ],
)
def test_a_constraint_that_cannot_be_compiled_is_a_400_naming_its_field(served, extra, field):
    body = {"messages": CHAT, "max_tokens": 4, **extra}
    code, reply = served.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    assert code == 400 and reply["error"]["param"].startswith(field), reply
