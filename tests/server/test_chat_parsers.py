"""The parsers of a chat answer: ``--tool-call-parser hermes`` (``tool_choice='auto'``'s calls
read back out of free text) and ``--reasoning-parser`` (a thinking model's reasoning apart), whole
and streamed in any chunking, into OpenAI's message and chunk shapes."""

from __future__ import annotations

import functools
import itertools
import json
import operator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.errors import InvalidRequestError
from moe_overlap.engine.loop import Delta
from moe_overlap.server.chat_answer import ChatAnswer
from moe_overlap.server.hermes import HermesStream, split_calls
from moe_overlap.server.reasoning import ReasoningStream, split_reasoning
from moe_overlap.server.responses import Choice, Formatter
from moe_overlap.server.settings import ServerSettings
from moe_overlap.server.tools import ToolSpec, tool_calling

CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
TOOLS = [
    ToolSpec(type="function", function={"name": "get_weather"}),
    ToolSpec(type="function", function={"name": "now"}),
]


def test_calls_are_read_after_the_text_and_what_is_not_a_call_stays_text():
    assert split_calls(CALLS) == (
        "Let me look.\n",
        [("get_weather", '{"city": "Oslo"}'), ("now", "{}")],
    )
    assert split_calls("no calls at all") is None
    assert split_calls('<tool_call>{"name": "now"') is None  # cut inside its JSON
    assert split_calls('<tool_call>{"arguments": {}}</tool_call>') is None  # no name
    # a last call the model did not close (no </tool_call> before EOS) still counts
    assert split_calls('<tool_call>{"name": "now", "arguments": {"a": 1}}') == (
        "",
        [("now", '{"a": 1}')],
    )


def streamed(stream: HermesStream | ReasoningStream, text: str, sizes: list[int]) -> tuple:
    """What ``stream`` sends, summed part by part, when ``text`` arrives in chunks of
    ``sizes`` (then whole, finished)."""
    ends = [min(len(text), at) for at in itertools.accumulate(sizes)]
    parts = [stream.step(text[:end], finished=False) for end in ends]
    parts.append(stream.step(text, finished=True))
    return tuple(functools.reduce(operator.add, column) for column in zip(*parts, strict=True))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=40))
def test_streamed_in_any_chunks_the_calls_and_text_are_the_whole_answers(sizes):
    assert streamed(HermesStream(), CALLS, sizes) == split_calls(CALLS)
    # text that only looked like the start of a call goes out in the end
    stream = HermesStream()
    assert stream.step("a <tool_c", finished=False) == ("a ", [])
    assert stream.step("a <tool_cx", finished=True) == ("<tool_cx", [])
    # a call that does not parse is text, and so is all after it
    stream = HermesStream()
    assert stream.step("<tool_call>{oops}</tool_call> more", finished=True) == (
        "<tool_call>{oops}</tool_call> more",
        [],
    )


BROKEN = (
    'Sure. <tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
    '<tool_call>{"name": oops}</tool_call> then <tool_call>{"name": "now"}</tool_call>'
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=40))
def test_a_block_that_does_not_parse_after_a_call_is_text_whole_as_streamed(sizes):
    """The calls before it stay calls and it and all after it are text, as the stream (which
    sent the first call already) has it; the whole answer made all of it text."""
    want = ("Sure. " + BROKEN[BROKEN.index("\n") :], [("now", "{}")])
    assert split_calls(BROKEN) == want
    assert streamed(HermesStream(), BROKEN, sizes) == want


def test_a_call_sent_before_a_broken_block_ends_the_stream_as_tool_calls():
    """Streamed in one delta, the call counted: finish_reason 'tool_calls' (it was 'stop')."""
    fmt, choice = _hermes_answer()
    delta = _delta(BROKEN, "eos")
    fmt.add(choice, 0, delta)
    (part,) = json.loads(fmt.chunk(0, delta, choice)[len("data: ") :])["choices"]
    whole = fmt.whole([choice])["choices"][0]
    assert part["finish_reason"] == whole["finish_reason"] == "tool_calls"
    assert [t["function"]["name"] for t in part["delta"]["tool_calls"]] == ["now"]
    assert [t["function"]["name"] for t in whole["message"]["tool_calls"]] == ["now"]


def _hermes_answer(reasoning: str | None = None) -> tuple[Formatter, Choice]:
    """A chat formatter reading hermes calls (after the reasoning, with a ``reasoning``
    parser), and its one choice."""
    calling = tool_calling(TOOLS, "auto", parser="hermes")
    assert calling is not None
    fmt = Formatter(chat=True, model="m", prompt_tokens=[3])
    fmt.answer = ChatAnswer(calling, reasoning)
    (choice,) = fmt.choices()
    return fmt, choice


def _delta(text: str, reason: str | None = None) -> Delta:
    return Delta(0, [1], text, prompt_tokens=3, completion_tokens=1, finish_reason=reason)


def test_auto_calls_come_back_as_tool_calls_whole_and_streamed():
    fmt, choice = _hermes_answer()
    pieces = [CALLS[i : i + 7] for i in range(0, len(CALLS), 7)]
    chunks = []
    for i, piece in enumerate(pieces):
        delta = _delta(piece, "eos" if i == len(pieces) - 1 else None)
        fmt.add(choice, 0, delta)
        chunks.append(json.loads(fmt.chunk(0, delta, choice)[len("data: ") :]))
    parts = [c["choices"][0] for c in chunks]
    assert "".join(p["delta"].get("content") or "" for p in parts) == "Let me look.\n"
    calls = [t for p in parts for t in p["delta"].get("tool_calls") or []]
    assert [(t["index"], t["function"]["name"]) for t in calls] == [(0, "get_weather"), (1, "now")]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parts[-1]["finish_reason"] == "tool_calls"
    whole = fmt.whole([choice])["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Let me look.\n"  # as it streamed (vLLM's)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "now"]
    # an answer without calls is the text, as it ended
    fmt, plain = _hermes_answer()
    fmt.add(plain, 0, _delta("just text", "length"))
    message = fmt.whole([plain])["choices"][0]
    assert message["message"] == {"role": "assistant", "content": "just text"}
    assert message["finish_reason"] == "length"


def test_auto_needs_the_servers_parser():
    with pytest.raises(InvalidRequestError, match="--enable-auto-tool-choice --tool-call-parser"):
        tool_calling(TOOLS, None)  # OpenAI's default with tools is 'auto'
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ServerSettings("m", enable_auto_tool_choice=True)
    assert ServerSettings("m", tool_call_parser="hermes").auto_tool_parser is None
    both = ServerSettings("m", enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert both.auto_tool_parser == "hermes"


THOUGHT = "<think>\nThe user wants Oslo's weather.\n</think>\n\n" + CALLS


def test_reasoning_is_read_apart_from_the_answer_by_each_parser():
    assert split_reasoning(THOUGHT, "qwen3") == ("\nThe user wants Oslo's weather.\n", CALLS)
    assert split_reasoning("plain answer", "qwen3") == (None, "plain answer")  # thinking off
    assert split_reasoning("<think>cut short", "qwen3") == ("cut short", "")
    # DeepSeek-R1's template opens <think>: the output starts inside it
    assert split_reasoning("so: 4</think>\n\nFour.", "deepseek_r1") == ("so: 4", "Four.")
    assert split_reasoning("still thinking", "deepseek_r1") == ("still thinking", "")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=60), st.sampled_from(["qwen3", "deepseek_r1"])
)
def test_streamed_reasoning_and_answer_add_up_to_the_whole_in_any_chunks(sizes, parser):
    for text in (THOUGHT, "no thoughts here", "<think>cut", "<thi"):
        thought, answer = streamed(ReasoningStream(parser), text, sizes)
        expected = split_reasoning(text, parser)
        assert (thought, answer) == (expected[0] or "", expected[1]), (text, parser)


def test_reasoning_then_calls_come_back_apart_whole_and_streamed():
    """A thinking model that calls: the reasoning in reasoning_content, the calls read from the
    answer after it; include_reasoning=false drops the reasoning."""
    answer = ChatAnswer(tool_calling(TOOLS, "auto", parser="hermes"), "qwen3")
    message, reason = answer.message(0, THOUGHT, "stop")
    assert message["reasoning_content"] == "\nThe user wants Oslo's weather.\n"
    assert message["content"] == "Let me look.\n"  # as it streams, below
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "now"]
    assert reason == "tool_calls"
    parts, at = [], 0
    while at < len(THOUGHT):
        at = min(len(THOUGHT), at + 5)
        parts.append(answer.delta(1, "", THOUGHT[:at], "stop" if at == len(THOUGHT) else None))
    assert "".join(p.get("reasoning_content", "") for p, _ in parts) == message["reasoning_content"]
    assert "".join(p.get("content") or "" for p, _ in parts) == message["content"]
    assert [t["function"]["name"] for p, _ in parts for t in p.get("tool_calls", [])] == [
        "get_weather",
        "now",
    ]
    assert parts[-1][1] == "tool_calls"
    hidden = ChatAnswer(None, "qwen3", show_reasoning=False)
    assert hidden.message(0, THOUGHT, "stop")[0] == {"role": "assistant", "content": CALLS}


CALL = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("output", "content"),
    [
        ("Let me look.\n\n" + CALL, "Let me look.\n\n"),  # text before the call, as it is
        ("\n " + CALL, "\n "),  # whitespace alone before it, kept
        (CALL + "\nDone.", None),  # text after it is dropped
        (" " + CALL + "\n " + CALL + " ", " "),  # between and after two calls: dropped
        ("no call at all, just text ", "no call at all, just text "),
        ("a <tool_c", "a <tool_c"),  # what only began like a call
        ("<tool_call>not json</tool_call> then text", "<tool_call>not json</tool_call> then text"),
        (CALL + "\n<tool_call>{bad}</tool_call> x", "\n<tool_call>{bad}</tool_call> x"),
    ],
)
@pytest.mark.parametrize("size", [1, 5, 1000])  # characters per delta, as tokens would come
@pytest.mark.parametrize("reasoning", [None, "qwen3"])
def test_the_whole_answer_holds_the_content_its_stream_sent(output, content, size, reasoning):
    """One rule for the text beside Hermes calls, whole and streamed (vLLM's): the text before
    the first call as the model wrote it, whitespace kept, and none after. The streamed
    ``content`` adds up to the whole answer's, and the calls are the same, after a reasoning
    parser too."""
    if reasoning is not None:  # the answer after it starts at its first line, whole or streamed
        lead = len(output) - len(output.lstrip("\n"))
        output = "<think>\nhmm\n</think>\n\n" + output
        content = content and (content[lead:] or None)
    fmt, streamed = _hermes_answer(reasoning)
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    sent, names = "", []
    for i, piece in enumerate(pieces):
        delta = _delta(piece, "eos" if i == len(pieces) - 1 else None)
        fmt.add(streamed, 0, delta)
        part = json.loads(fmt.chunk(0, delta, streamed)[len("data: ") :])["choices"][0]
        sent += part["delta"].get("content") or ""
        names += [t["function"]["name"] for t in part["delta"].get("tool_calls") or []]
    message = fmt.whole([streamed])["choices"][0]["message"]
    assert message["content"] == content
    assert sent == (content or "")
    assert [c["function"]["name"] for c in message.get("tool_calls") or []] == names
