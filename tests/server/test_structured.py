"""Structured outputs through the server at ep=2 with two-batch overlap, driven by the ``openai``
client: every way OpenAI, vLLM and SGLang ask for one, with n, logprobs, stop and streaming, and
a constraint xgrammar refuses answered 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

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

    def three():  # n > 1 and completions' logprobs, beside the twenty
        return client.completions.create(
            model="tiny",
            prompt="A fox:",
            n=3,
            seed=5,
            logprobs=2,
            max_tokens=60,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        ).choices

    with ThreadPoolExecutor(21) as pool:
        n3 = pool.submit(three)
        choices = list(pool.map(ask, range(20)))
    assert all(c.finish_reason == "stop" and valid(c.message.content) for c in choices)
    assert len({c.message.content for c in choices}) > 1  # sampled, not one answer
    assert served.server.engine.llm.scheduler.preemptions > 0
    with_logprobs = choices[0].logprobs
    assert with_logprobs is not None and "".join(t.token for t in with_logprobs.content)
    assert len(n3.result()) == 3 and all(valid(c.text) for c in n3.result())
    assert all(len(c.logprobs.tokens) > 0 for c in n3.result())
    # alone and streamed, a request gives what it gave among twenty with preemptions
    chunks = client.chat.completions.create(**ask_args(7), stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choices[7].message.content


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

    def completion(extra: dict, **kw) -> str:
        kw = {"seed": 3, "max_tokens": 60, **kw}
        reply = client.completions.create(model="tiny", prompt="Answer:", extra_body=extra, **kw)
        return reply.choices[0].text

    def json_object() -> str:  # any JSON object: it starts as one (it may run on inside it)
        form = {"type": "json_object"}
        reply = client.chat.completions.create(
            model="tiny", messages=CHAT, response_format=form, seed=1, max_tokens=8
        )
        return reply.choices[0].message.content

    def native() -> str:
        sampling = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 60, "sampling_seed": 2}
        return post(served, "/generate", {"text": "Answer:", "sampling_params": sampling})[1][
            "text"
        ]

    calls = [(partial(completion, extra), matches) for extra, matches in asks]
    calls += [
        (json_object, lambda t: t.startswith("{")),
        (native, valid),
        # a stop string cuts the constrained output: what is left is the regex's prefix
        (
            partial(completion, asks[0][0], seed=4, stop=["c"]),
            lambda t: re.fullmatch(r"[ab]*x?", t),
        ),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:
        texts = list(pool.map(lambda call: call[0](), calls))
    for (call, matches), text in zip(calls, texts, strict=True):
        assert matches(text), (call, text)


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
        ({"regex": "[z-a]"}, "regex"),
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
    if set(extra) == {field} <= {"regex", "ebnf"}:  # SGLang's, in /generate's sampling_params too
        sampling = {**extra, "max_new_tokens": 4}
        code, reply = post(served, "/generate", {"text": "hi", "sampling_params": sampling})
        assert code == 400 and reply["error"]["param"] == f"sampling_params.{field}", reply
