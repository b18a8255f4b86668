"""The Hermes call format (``--tool-call-parser hermes``), which Qwen2.5, Qwen3 and Qwen3-MoE's chat
templates teach: any text, then calls, each ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``. With ``tool_choice="auto"`` the model decides whether to call; this reads its
calls back out of the text, whole and streamed.

Streamed, the text before the first call goes out as it comes (holding back what may be the
start of ``<tool_call>``), and each call goes out whole once its ``</tool_call>`` arrives (an
unclosed one at the end, if it parses). A call whose JSON does not parse is text, and so is
all after it (the calls before it stay calls, whole as streamed). What follows the calls is
dropped, as vLLM's parser drops it.

One rule for the text, whole and streamed alike (vLLM's): the message's ``content`` is the text
before the first call as the model wrote it, whitespace kept (a newline before the call, or
whitespace alone, stays; SGLang strips it), and None where there is none. So a stream's
``content`` adds up to the whole answer's: ``split_calls`` and ``HermesStream`` cut the text at
the same places, and neither strips it (nor may ``tools.py``, which builds the message).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from moe_overlap.engine.detokenize import held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

Call = tuple[str, str]  # a call's name and its arguments as JSON text


def read_call(body: str) -> Call | None:
    """One call's ``{"name": ..., "arguments": ...}``, or None where it is not one."""
    try:
        value = json.loads(body, strict=False)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _blocks(text: str, start: int, finished: bool) -> list[tuple[str, int]]:
    """Each call's body from ``start`` on, with where it ends; once ``finished``, a last call
    that was not closed (cut short, or no EOS) too."""
    blocks = [(m.group(1), m.end()) for m in _BLOCK.finditer(text, start)]
    tail = text.rfind(OPEN)
    if finished and tail >= start and text.find(CLOSE, tail) < 0:
        blocks.append((text[tail + len(OPEN) :], len(text)))
    return blocks


def split_calls(text: str) -> tuple[str, list[Call]] | None:
    """The text beside the calls and the calls (an unclosed last one included), or None when
    ``text`` opens with no call that parses (then all of it is the answer's text). As a stream
    sends them: the calls before the first block that does not parse, and that block and all
    after it as text, following the text before the first call."""
    start = text.find(OPEN)
    calls: list[Call] = []
    end = start
    for body, block_end in _blocks(text, start, finished=True) if start >= 0 else []:
        call = read_call(body)
        if call is None:
            return (text[:start] + text[end:], calls) if calls else None
        calls.append(call)
        end = block_end
    return (text[:start], calls) if calls else None


@dataclass
class HermesStream:
    """One streamed choice: how much text went out, and how many calls."""

    sent: int = 0  # characters of the output sent as text, or read as calls
    calls: int = 0
    failed: bool = False  # a call did not parse: the rest streams as text

    def step(self, whole: str, finished: bool) -> tuple[str, list[Call]]:
        """The text and calls to send now that the output reads ``whole``."""
        start = whole.find(OPEN)
        if self.failed or start < 0:
            end = len(whole) if finished or self.failed else len(whole) - held_back(whole, [OPEN])
            text, self.sent = whole[self.sent : end], max(self.sent, end)
            return text, []
        text = whole[self.sent : start] if self.calls == 0 else ""
        self.sent = max(self.sent, start)
        calls: list[Call] = []
        for body, end in _blocks(whole, start, finished)[self.calls :]:
            call = read_call(body)
            if call is None:  # not a call after all: the rest is text
                self.failed, self.calls = True, self.calls + len(calls)
                rest, self.sent = whole[self.sent :], len(whole)
                return text + rest, calls
            calls.append(call)
            self.sent = end
        self.calls += len(calls)
        return text, calls
