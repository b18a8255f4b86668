"""Tool calling on chat (OpenAI's ``tools`` and ``tool_choice``), by structured outputs: no
parser of a model's own call format is needed, as vLLM's named and ``required`` function
calling needs none.

- The tools reach the prompt through the chat template (its ``tools`` variable), whatever the
  choice; a template that ignores them (the tiny models') renders the conversation alone.
- ``tool_choice="none"`` (and no ``tool_choice`` with no tools): the answer is text.
- A named function (``{"type": "function", "function": {"name": ...}}``): the output is held to
  that function's ``parameters`` schema and comes back as one call whose ``arguments`` is it.
- ``"required"``: the output is held to a JSON array of one or more ``{"name", "parameters"}``
  objects, one schema per tool (``anyOf``), and comes back as that many calls.
- ``"auto"`` (OpenAI's default when tools are sent) lets the model decide whether to call, which
  needs a parser of that model's call format (vLLM's ``--tool-call-parser``); this server has
  none, so it is refused, naming the choices that work.

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


@dataclass
class ToolCalling:
    """A request's calls: to ``forced`` (a named function) or, with None, ``required``."""

    tools: list[ToolSpec]
    forced: str | None
    parallel: bool = True  # False: ``required`` makes exactly one call
    ids: dict[int, list[str]] = field(default_factory=dict)  # per choice: its calls' ids

    def constraint(self) -> StructuredOutputs:
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

    def calls(self, index: int, text: str) -> list[dict] | None:
        """Choice ``index``'s calls in OpenAI's shape, or None where ``text`` is not whole."""
        try:
            parsed = json.loads(text, strict=False)  # xgrammar lets control characters in
        except ValueError:
            return None
        if self.forced is not None:
            named = [(self.forced, text)]
        else:  # the schema's shape (xgrammar held the output to it)
            named = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed]
        ids = self.ids.setdefault(index, [])
        ids += [f"chatcmpl-tool-{uuid.uuid4().hex}" for _ in range(len(named) - len(ids))]
        return [
            {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}
            for id_, (name, arguments) in zip(ids, named, strict=False)
        ]

    def message(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The whole answer's message and finish reason."""
        calls = self.calls(index, text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        reason = "tool_calls" if self.forced is None else finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, reason

    def delta(self, index: int, added: str, whole: str, finished: bool) -> dict | None:
        """A streamed delta's message part, or None (nothing to send yet). A named function's
        arguments stream as they come (the call's id and name first); ``required``'s calls
        are sent whole at the end, when the array is known."""
        if self.forced is not None:
            first = index not in self.ids
            call: dict = {"index": 0, "function": {"arguments": added}}
            if first:
                self.ids[index] = [f"chatcmpl-tool-{uuid.uuid4().hex}"]
                call |= {"id": self.ids[index][0], "type": "function"}
                call["function"] = {"name": self.forced, "arguments": added}
            return {"tool_calls": [call]} if added or first else None
        if not finished:
            return None
        calls = self.calls(index, whole)
        if calls is None:
            return {"content": whole}
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}


def tool_calling(
    tools: list[ToolSpec] | None, choice: ToolChoice | None, parallel: bool = True
) -> ToolCalling | None:
    """What ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask of the output: None for
    text."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise InvalidRequestError(f"tool_choice={_shown(choice)} needs tools", "tool_choice")
    if choice == "auto":
        raise InvalidRequestError(
            "tool_choice='auto' (the default with tools) lets the model decide whether to call, "
            "which needs a parser of its call format, and this server has none; send "
            "tool_choice='required' or a named function (the output is held to the tools' "
            "schemas), or 'none'",
            "tool_choice",
        )
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequestError(f"tools name a function twice: {names}", "tools")
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
