"""A thinking model's reasoning apart from its answer (``--reasoning-parser``, vLLM's and
SGLang's flag): chat's ``message.reasoning_content`` and, streamed, ``delta.reasoning_content``.

- ``qwen3``: Qwen3's ``<think>...</think>`` at the start of the output. An output that does not
  open with ``<think>`` (thinking off) is all answer; one cut short before ``</think>`` is all
  reasoning, whole as streamed (vLLM's whole-answer parser calls it answer, which a stream that
  already sent it as reasoning cannot take back).
- ``deepseek_r1``: DeepSeek-R1's, whose template opens the ``<think>`` itself: everything up to
  ``</think>`` is reasoning (a ``<think>`` the model writes first is dropped), and an output
  cut before ``</think>`` is all reasoning.

The answer (after ``</think>``, its leading newlines dropped) is what tool calls are read from.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.engine.detokenize import held_back

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """The reasoning (None: none) and the answer of a whole output."""
    body = text.lstrip()
    opened = body.startswith(START)
    if opened:
        body = body[len(START) :]
    end = body.find(END)
    if parser == "qwen3" and not opened:
        return None, text
    if end < 0:
        return body, ""
    return body[:end], body[end + len(END) :].lstrip("\n")


@dataclass
class ReasoningStream:
    """One streamed choice: what went out as reasoning and as answer so far."""

    parser: str
    reasoning_sent: int = 0  # characters of the output sent as reasoning
    answer: str = ""  # the answer sent so far

    def step(self, whole: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the answer to add now that the output reads ``whole``: nothing
        while it may still be the start of ``<think>`` or of ``</think>``."""
        if finished:
            reasoning, answer = split_reasoning(whole, self.parser)
        else:
            reasoning, answer = self._so_far(whole)
        added = "" if reasoning is None else reasoning[self.reasoning_sent :]
        self.reasoning_sent += len(added)
        new = answer[len(self.answer) :]
        self.answer += new
        return added, new

    def _so_far(self, whole: str) -> tuple[str | None, str]:
        body = whole.lstrip()
        if self.parser == "qwen3" and not body.startswith(START):
            if START.startswith(body):  # may yet open <think>
                return None, self.answer
            return None, whole
        if body.startswith(START):
            body = body[len(START) :]
        elif START.startswith(body):
            return "", self.answer
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :].lstrip("\n")
        return body[: len(body) - held_back(body, [END])], self.answer
