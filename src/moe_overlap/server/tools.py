"""Tool calling on chat (OpenAI's ``tools`` and ``tool_choice``): named and ``required`` by
structured outputs, which need no parser of a model's own call format (as vLLM's need none),
and ``auto`` by the Hermes parser.

- The tools reach the prompt through the chat template (its ``tools`` variable), whatever the
  choice; a template that ignores them (the tiny models') renders the conversation alone.
- ``tool_choice="none"`` (and no ``tool_choice`` with no tools): the answer is text.
- A named function (``{"type": "function", "function": {"name": ...}}``): the output is held to
  that function's ``parameters`` schema and comes back as one call whose ``arguments`` is it.
- ``"required"``: the output is held to a JSON array of one or more ``{"name", "parameters"}``
  objects, one schema per tool (``anyOf``), and comes back as that many calls.
- ``"auto"`` (OpenAI's default when tools are sent) lets the model decide whether to call, which
  needs a parser of that model's call format: with ``--enable-auto-tool-choice
  --tool-call-parser hermes`` (vLLM's flags) the output is free and its calls are read back in
  the Hermes format (``hermes.py``); without them it is refused, naming what works.

An output cut by ``max_tokens`` is not a whole call: it comes back as text, with
``finish_reason`` ``length``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from moe_overlap.engine.errors import InvalidRequestError
from moe_overlap.engine.structured import StructuredOutputs
from moe_overlap.server.hermes import Call, HermesStream, split_calls

ANY_OBJECT = {"type": "object"}  # a function that declares no parameters takes any object


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _shaped(ids: list[str], named: list[Call]) -> list[dict]:
    return [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
        for id_, (name, arguments) in zip(ids, named, strict=True)
    ]


def _new_ids(count: int) -> list[str]:
    return [f"chatcmpl-tool-{uuid.uuid4().hex}" for _ in range(count)]


@dataclass
class ToolCalling:
    """A request's calls: to ``forced`` (a named function), ``required`` (forced None, not
    ``auto``) or, with ``auto``, as the model decides, read back in the Hermes format."""

    tools: list[ToolSpec]
    forced: str | None
    parallel: bool = True  # False: ``required`` makes exactly one call
    auto: bool = False
    named_ids: dict[int, str] = field(default_factory=dict)  # a named call's id, per choice
    streams: dict[int, HermesStream] = field(default_factory=dict)  # auto, per choice

    def constraint(self) -> StructuredOutputs | None:
        if self.auto:
            return None
        if self.forced is not None:
            function = next(t.function for t in self.tools if t.function.name == self.forced)
            return StructuredOutputs(json=function.parameters or ANY_OBJECT, field="tools")
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": t.function.parameters or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, field="tools")

    def read(self, text: str) -> tuple[str | None, list[Call]] | None:
        """The text beside the calls and the calls, or None where ``text`` holds none whole."""
        if self.auto:
            found = split_calls(text)
            # the text as it streamed, whitespace kept (vLLM's; SGLang strips the whole one)
            return None if found is None else (found[0] or None, found[1])
        try:
            parsed = json.loads(text, strict=False)  # xgrammar lets control characters in
        except ValueError:
            return None
        if self.forced is not None:
            return None, [(self.forced, text)]
        # the schema's shape (xgrammar held the output to it)
        return None, [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed]

    def message(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's message and finish reason."""
        found = self.read(text)
        if found is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, named = found
        calls = _shaped(_new_ids(len(named)), named)
        if self.forced is None and finish_reason == "stop":
            finish_reason = "tool_calls"  # a named call ends as OpenAI's forced call: "stop"
        return {"role": "assistant", "content": content, "tool_calls": calls}, finish_reason

    def delta(
        self, index: int, added: str, whole: str, reason: str | None
    ) -> tuple[dict | None, str | None]:
        """A streamed delta's message part (None: nothing to send yet) and finish reason. A
        named function's arguments stream as they come (the call's id and name first);
        ``required``'s calls go whole at the end, when the array is known; ``auto``'s text as
        it comes and each call once closed (``hermes.py``)."""
        if self.forced is not None:
            first = index not in self.named_ids
            call: dict = {"index": 0, "function": {"arguments": added}}
            if first:
                self.named_ids[index] = _new_ids(1)[0]
                call |= {"id": self.named_ids[index], "type": "function"}
                call["function"] = {"name": self.forced, "arguments": added}
            return ({"tool_calls": [call]} if added or first else None), reason
        if self.auto:
            return self._auto_delta(index, whole, reason)
        if reason is None:
            return None, None
        message, reason = self.message(index, whole, reason)
        if "tool_calls" not in message:
            return {"content": whole}, reason
        return {
            "tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        }, reason

    def _auto_delta(
        self, index: int, whole: str, reason: str | None
    ) -> tuple[dict | None, str | None]:
        stream = self.streams.setdefault(index, HermesStream())
        before = stream.calls
        text, named = stream.step(whole, reason is not None)
        part: dict = {"content": text} if text else {}
        if named:
            calls = _shaped(_new_ids(len(named)), named)
            part["tool_calls"] = [{"index": before + i, **c} for i, c in enumerate(calls)]
        if reason == "stop" and stream.calls:
            reason = "tool_calls"
        return part or None, reason


def tool_calling(
    tools: list[ToolSpec] | None,
    choice: ToolChoice | None,
    parallel: bool = True,
    parser: str | None = None,
) -> ToolCalling | None:
    """What ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of the output, None for
    text; ``parser``: the server's ``--tool-call-parser`` where ``--enable-auto-tool-choice``
    is on (``auto`` needs it)."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice={_shown(choice)} needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequestError(f"tools name a function twice: {names}", "tools")
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(
                "tool_choice='auto' (the default with tools) lets the model decide whether to "
                "call, which needs a parser of its call format: start the server with "
                "--enable-auto-tool-choice --tool-call-parser hermes (Qwen's and Hermes' "
                "format), or send tool_choice='required' or a named function (the output is "
                "held to the tools' schemas), or 'none'",
                "tool_choice",
            )
        return ToolCalling(tools, None, parallel, auto=True)
    if choice == "required":
        return ToolCalling(tools, None, parallel)
    assert isinstance(choice, NamedToolChoice)
    if choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names {choice.function.name!r}, which is not among tools {names}",
            "tool_choice",
        )
    return ToolCalling(tools, choice.function.name)


def _shown(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())
