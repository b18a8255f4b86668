"""A chat request's prompt: its conversation through the chat template, with vLLM's controls
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) and the
request's ``tools`` as the template's variables. What the template cannot render, or a value
that would write the template's own markers outside a message's text, is a 400 naming it."""

from __future__ import annotations

import jinja2
from transformers import PreTrainedTokenizerFast

from moe_overlap.engine.errors import InvalidRequestError
from moe_overlap.engine.tokenizer import encode_chat
from moe_overlap.server.guards import APIError
from moe_overlap.server.protocol import ChatRequest

# apply_chat_template's own arguments, which chat_template_kwargs may not set
RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
        "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
        "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    }
)  # fmt: skip


def chat_prompt_ids(tok: PreTrainedTokenizerFast, body: ChatRequest) -> list[int]:
    if body.add_generation_prompt and body.continue_final_message:
        message = (
            "continue_final_message=true goes on with the last message, so it needs "
            "add_generation_prompt=false (which opens a new turn)"
        )
        raise APIError(400, message, "invalid_value", "continue_final_message")
    kwargs = body.chat_template_kwargs or {}
    taken = sorted(RESERVED & set(kwargs))
    if taken:
        message = f"chat_template_kwargs sets {taken}, which the request's own fields set"
        raise APIError(400, message, "invalid_value", "chat_template_kwargs")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    conversation = body.conversation()
    # a message's text is kept as text (encode_chat); the rest must not hold the markers
    outside = {
        "tools": tools,
        "chat_template_kwargs": kwargs,
        "messages": [{k: v for k, v in m.items() if k != "content"} for m in conversation],
    }
    for name, value in outside.items():
        marker = _special_text(tok, value)
        if marker:
            message = f"{name} holds the special token text {marker!r}, which would forge a turn"
            raise APIError(400, message, "invalid_value", name)
    try:
        return encode_chat(
            tok,
            conversation,
            body.add_generation_prompt,
            continue_final=body.continue_final_message,
            tools=tools,
            template_kwargs=kwargs,
        )
    except InvalidRequestError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        message = f"the chat template cannot render these messages: {exc}"
        raise APIError(400, message, "invalid_value", "messages") from None


def _special_text(tok: PreTrainedTokenizerFast, value: object) -> str | None:
    text = repr(value)  # every string inside, in one text to search
    return next((s for s in tok.all_special_tokens if s and s in text), None)
