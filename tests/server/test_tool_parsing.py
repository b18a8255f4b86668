"""``tool_choice='auto'`` with ``--tool-call-parser hermes``: the calls read back out of a model's
free text, whole and streamed in any chunking, into OpenAI's message and chunk shapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.errors import InvalidRequestError
from moe_overlap.engine.loop import Delta
from moe_overlap.server.hermes import HermesStream, split_calls
from moe_overlap.server.responses import Formatter
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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=40))
def test_streamed_in_any_chunks_the_calls_and_text_are_the_whole_answers(sizes):
    text, calls, stream, at = "", [], HermesStream(), 0
    for size in sizes:
        at = min(len(CALLS), at + size)
        sent, new = stream.step(CALLS[:at], finished=False)
        text, calls = text + sent, calls + new
    sent, new = stream.step(CALLS, finished=True)
    text, calls = text + sent, calls + new
    assert (text, calls) == split_calls(CALLS)
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


def _delta(text: str, reason: str | None = None) -> Delta:
    return Delta(0, [1], text, prompt_tokens=3, completion_tokens=1, finish_reason=reason)


def test_auto_calls_come_back_as_tool_calls_whole_and_streamed():
    calling = tool_calling(TOOLS, "auto", parser="hermes")
    fmt = Formatter(chat=True, model="m", prompt_tokens=[3])
    fmt.tools = calling
    (choice,) = fmt.choices()
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
    assert whole["message"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather", "now"]
    # an answer without calls is the text, as it ended
    fmt = Formatter(chat=True, model="m", prompt_tokens=[3])
    fmt.tools = calling
    (plain,) = fmt.choices()
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
