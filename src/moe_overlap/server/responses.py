"""OpenAI's response bodies for completions and chat, whole and as server-sent-event chunks.

Each choice also carries ``token_ids`` (as vLLM's ``return_token_ids`` does), so a client of a
model without a tokenizer still gets its tokens."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from moe_overlap.engine.loop import Delta
from moe_overlap.server.protocol import FINISH_REASONS

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.prompt_tokens = delta.prompt_tokens
        if delta.finish_reason:
            self.finish_reason = FINISH_REASONS[delta.finish_reason]


class Formatter:
    """The ids, timestamps and shapes of one call's responses (``chat`` or completion)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: list[int]):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens  # per choice

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self, choices: list[Choice]) -> dict:
        prompt = sum(self.prompt_tokens)
        completion = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def whole(self, choices: list[Choice]) -> dict:
        if self.chat:
            body = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                    "token_ids": c.token_ids,
                }
                for i, c in enumerate(choices)
            ]
        else:
            body = [
                {
                    "index": i,
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": None,
                    "token_ids": c.token_ids,
                }
                for i, c in enumerate(choices)
            ]
        name = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(name, body), "usage": self.usage(choices)}

    def chunk(self, index: int, delta: Delta | None) -> str:
        """One streamed event: a delta of choice ``index`` (None: the chat's opening role)."""
        reason = FINISH_REASONS[delta.finish_reason] if delta and delta.finish_reason else None
        ids = delta.token_ids if delta else []
        if self.chat:
            part = {"content": delta.text} if delta else {"role": "assistant", "content": ""}
            choice = {"index": index, "delta": part, "finish_reason": reason, "token_ids": ids}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        text = delta.text if delta else ""
        choice = {"index": index, "text": text, "finish_reason": reason, "token_ids": ids}
        return sse(self._envelope("text_completion", [{**choice, "logprobs": None}]))

    def usage_chunk(self, choices: list[Choice]) -> str:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._envelope(name, []), "usage": self.usage(choices)})
