"""How a chat choice's output becomes its message and its streamed deltas, where more than text
is asked for: the reasoning apart first (``reasoning.py``, ``--reasoning-parser``), then tool
calls read from the answer that follows it (``tools.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_overlap.server.reasoning import ReasoningStream, split_reasoning
from moe_overlap.server.tools import ToolCalling


@dataclass
class ChatAnswer:
    tools: ToolCalling | None = None
    reasoning: str | None = None  # the parser, where the request keeps reasoning apart
    show_reasoning: bool = True  # vLLM's include_reasoning: False drops it from the answer
    streams: dict[int, ReasoningStream] = field(default_factory=dict)  # per streamed choice

    def message(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        """Choice ``index``'s whole message and finish reason."""
        thought, answer = None, text
        if self.reasoning is not None:
            thought, answer = split_reasoning(text, self.reasoning)
        if self.tools is not None:
            message, reason = self.tools.message(index, answer, reason)
        else:
            message = {"role": "assistant", "content": answer}
        if thought is not None and self.show_reasoning:
            message["reasoning_content"] = thought
        return message, reason

    def delta(
        self, index: int, added: str, whole: str, reason: str | None
    ) -> tuple[dict, str | None]:
        """A streamed delta's message part and finish reason: ``added`` is the text this delta
        added, ``whole`` the output so far."""
        thought = ""
        if self.reasoning is not None:
            stream = self.streams.setdefault(index, ReasoningStream(self.reasoning))
            thought, added = stream.step(whole, reason is not None)
            whole = stream.answer
        part: dict = {"content": added} if added or self.reasoning is None else {}
        if self.tools is not None:
            tool_part, reason = self.tools.delta(index, added, whole, reason)
            part = tool_part or {}
        if thought and self.show_reasoning:
            part["reasoning_content"] = thought
        return part, reason
