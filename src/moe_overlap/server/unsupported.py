"""OpenAI request fields this server does not implement. Each is refused with a 400 that names
it when set to anything but a value that changes nothing, so no client (an evaluation harness
asking for log-probabilities, say) gets a plain answer that silently ignored what it asked for.
Fields the OpenAI API does not define are ignored, as vLLM ignores them.
"""

from __future__ import annotations

from collections.abc import Mapping

# field -> the values that change nothing, and what to say when another is sent
_BOTH = {
    "min_p": ((None, 0), "min_p"),
}
_COMPLETIONS = {
    "suffix": ((None, ""), "suffix (insertion)"),
}
_CHAT = {
    "tools": ((None, []), "tools"),
    "tool_choice": ((None, "none", "auto"), "tools"),
    "functions": ((None, []), "functions"),
    "function_call": ((None, "none", "auto"), "functions"),
    "audio": ((None,), "audio output"),
    "modalities": ((None, ["text"]), "output other than text"),
    "prediction": ((None,), "predicted outputs"),
}


def unsupported_field(body: Mapping, chat: bool) -> tuple[str, str] | None:
    """The first field of ``body`` this server cannot honour, and the message to refuse it
    with; None when every field can be served as asked."""
    for name, (no_ops, what) in {**_BOTH, **(_CHAT if chat else _COMPLETIONS)}.items():
        if name in body and not any(_same(body[name], v) for v in no_ops):
            return name, f"{name}={body[name]!r:.60}: {what} is not supported by this server"
    messages = (body.get("messages") or []) if chat else []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                where = f"messages[{i}].content[{j}]"
                return where, f"{where}.type={kind!r}: only text parts are supported"
    return None


def _same(value: object, no_op: object) -> bool:
    if isinstance(no_op, bool) or isinstance(value, bool):
        return value is no_op
    return value == no_op
