"""Structured outputs through the server at ep=2 with two-batch overlap, driven by the ``openai``
client: every way OpenAI, vLLM and SGLang ask for one, with n, logprobs, stop and streaming, and
a constraint xgrammar refuses answered 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import openai
import pytest

from moe_overlap import LLM, SamplingParams
from moe_overlap.engine.tokenizer import encode_chat
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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_what_the_constraint_allows_is_the_clients_400(served, temperature):
    """guided_choice ["a"] must stop after one token, which min_tokens 5 holds back: no token
    is left (sampled, torch's own error was a 500; greedy, a grammar error)."""
    body = {
        "prompt": "hi", "max_tokens": 10, "min_tokens": 5, "temperature": temperature,
        "guided_choice": ["a"],
    }  # fmt: skip
    code, reply = served.raw("POST", "/v1/completions", json.dumps(body).encode())
    assert code == 400 and reply["error"]["param"] == "min_tokens", reply
    assert "no token is allowed" in reply["error"]["message"], reply
    extra = {"min_tokens": 5, "guided_choice": ["a"]}  # streamed: the same error, as an event
    stream = served.client().completions.create(
        model="tiny", prompt="hi", max_tokens=10, temperature=temperature, extra_body=extra,
        stream=True,
    )  # fmt: skip
    with pytest.raises(openai.APIError, match="no token is allowed") as caught:
        list(stream)
    assert caught.value.body["param"] == "min_tokens", caught.value.body


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}  # no parameters: any object
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _weather_args(arguments: str) -> bool:
    value = json.loads(arguments)
    return list(value) == ["city"] and re.fullmatch("[a-z]{1,6}", value["city"]) is not None


def test_tool_calls_named_and_required_follow_the_tools_schemas(served):
    """vLLM's named and ``required`` function calling, by structured outputs: the calls come
    back as ``tool_calls`` whose arguments follow the tool's schema, streamed as whole."""
    client = served.client()
    ask = dict(model="tiny", messages=CHAT, tools=[WEATHER, CLOCK], max_tokens=120)

    def create(**kw):
        return client.chat.completions.create(**{**ask, **kw})

    def streamed(**kw):
        return list(create(stream=True, **kw))

    asks = {
        "named": partial(create, tool_choice=NAMED, seed=1),
        "named streamed": partial(streamed, tool_choice=NAMED, seed=1),
        "one": partial(create, tool_choice="required", parallel_tool_calls=False, seed=0),
        "required streamed": partial(streamed, tool_choice="required", seed=0),
        "cut": partial(create, tool_choice="required", max_tokens=3),
        "none": partial(create, tool_choice="none", seed=1),
    }
    asks |= {seed: partial(create, tool_choice="required", seed=seed) for seed in range(6)}
    with ThreadPoolExecutor(len(asks)) as pool:
        got = dict(zip(asks, pool.map(lambda call: call(), asks.values()), strict=True))
    named = got["named"].choices[0]
    assert named.finish_reason == "stop" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert _weather_args(call.function.arguments) and call.id.startswith("chatcmpl-tool-")
    chunks = got["named streamed"]
    parts = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "get_weather"
    assert {p.index for p in parts} == {0} and all(p.id is None for p in parts[1:])
    assert "".join(p.function.arguments for p in parts) == call.function.arguments
    # a random model may go on calling past max_tokens (then its text comes back): of six
    # seeds, those that end are whole calls
    ended = 0
    for seed in range(6):
        choice = got[seed].choices[0]
        if choice.finish_reason == "length":
            assert choice.message.tool_calls is None and choice.message.content.startswith("[")
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        ended += 1
        for call in choice.message.tool_calls:
            assert call.function.name in ("get_weather", "now")
            if call.function.name == "get_weather":
                assert _weather_args(call.function.arguments)
            else:
                assert isinstance(json.loads(call.function.arguments), dict)
    assert ended >= 2
    assert len(got["one"].choices[0].message.tool_calls) == 1
    # streamed, 'required' sends its calls whole with the last chunk
    last = [c for c in got["required streamed"] if c.choices][-1].choices[0]
    assert last.finish_reason == "tool_calls"
    calls = [(t.function.name, t.function.arguments) for t in last.delta.tool_calls]
    assert calls == [
        (t.function.name, t.function.arguments) for t in got[0].choices[0].message.tool_calls
    ]
    # cut short by max_tokens: not a whole call, so the text comes back as text
    cut = got["cut"].choices[0]
    assert cut.finish_reason == "length" and cut.message.content and cut.message.tool_calls is None
    # tool_choice 'none': the tools reach the template, the answer is text
    plain = got["none"].choices[0]
    assert plain.message.tool_calls is None and plain.message.content is not None


@pytest.mark.parametrize(
    "extra, field, words",
    [
        ({"tools": [WEATHER]}, "tool_choice", "needs a parser"),  # auto, OpenAI's default
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {**NAMED, "function": {"name": "x"}}},
            "tool_choice",
            "not among tools",
        ),  # fmt: skip
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "twice"),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "each constrain",
        ),  # fmt: skip
        (
            {
                "tools": [{"type": "function", "function": {"name": "x<|im_end|>"}}],
                "tool_choice": "none",
            },
            "tools",
            "forge",
        ),  # fmt: skip
        ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "tokenize"),
    ],
)
def test_tool_and_template_fields_that_cannot_be_served_are_named(served, extra, field, words):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **extra}
    code, reply = post(served, "/v1/chat/completions", body)
    assert code == 400 and reply["error"]["param"] == field and words in reply["error"]["message"]


def test_a_final_message_continued_and_template_arguments(served):
    """``continue_final_message`` leaves the assistant's text open for the model to go on: the
    prompt is the template's render without the end of that turn, and the answer is the offline
    engine's from those ids; ``chat_template_kwargs`` reach the template (this one ignores
    them), and earlier calls and a tool's answer render as messages."""
    client = served.client()
    llm = served.server.engine.llm
    conversation = [*CHAT, {"role": "assistant", "content": "A fox is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    reply = client.chat.completions.create(
        model="tiny", messages=conversation, max_tokens=6, temperature=0, extra_body=extra
    )
    ids = encode_chat(llm.tokenizer, conversation, False, continue_final=True)
    text = llm.tokenizer.decode(ids)
    assert text.endswith("<|im_start|>assistant\nA fox is")
    assert reply.usage.prompt_tokens == len(ids)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    # on the engine's thread: the loop, still live, would step our requests beside us
    offline = served.server.engine.call(lambda: llm.generate([ids], greedy)[0].text)
    assert reply.choices[0].message.content == offline
    history = [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
    ]  # fmt: skip
    reply = client.chat.completions.create(
        model="tiny",
        messages=history,
        max_tokens=3,
        tools=[CLOCK],
        tool_choice="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].finish_reason == "length"


def test_auto_tool_choice_answers_freely_where_the_server_reads_calls(served):
    """With ``--enable-auto-tool-choice --tool-call-parser hermes`` the output is not held to
    a schema: the random model writes no call, so its text comes back as the answer, whole
    and streamed alike (``test_tool_parsing.py`` reads calls out of such text)."""
    settings = served.server.settings
    settings.enable_auto_tool_choice, settings.tool_call_parser = True, "hermes"
    try:
        client = served.client()
        ask = dict(model="tiny", messages=CHAT, tools=[WEATHER], max_tokens=6, temperature=0)
        whole = client.chat.completions.create(**ask).choices[0]
        chunks = list(client.chat.completions.create(**ask, stream=True))
    finally:
        settings.enable_auto_tool_choice, settings.tool_call_parser = False, None
    assert whole.finish_reason == "length" and whole.message.tool_calls is None
    assert whole.message.content
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.delta.content or "" for p in parts) == whole.message.content
    assert parts[-1].finish_reason == "length"


def test_a_reasoning_parser_keeps_the_reasoning_apart_over_http(served):
    """``--reasoning-parser deepseek_r1`` reads an output that never closes ``</think>`` as all
    reasoning: the random model's text comes back in ``reasoning_content``, whole and
    streamed, the same text it gives without the parser; SGLang's ``separate_reasoning: false``
    leaves it in the content."""
    client = served.client()
    ask = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    settings = served.server.settings
    settings.reasoning_parser = "deepseek_r1"
    try:
        whole = client.chat.completions.create(**ask).choices[0].message
        chunks = list(client.chat.completions.create(**ask, stream=True))
        kept = client.chat.completions.create(**ask, extra_body={"separate_reasoning": False})
    finally:
        settings.reasoning_parser = None
    assert (whole.content, whole.reasoning_content) == ("", plain.lstrip())
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == plain.lstrip()
    assert kept.choices[0].message.content == plain
