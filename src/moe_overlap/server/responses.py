"""OpenAI's response bodies for completions and chat, whole and as server-sent-event chunks.

Each choice also carries ``token_ids`` (as vLLM's ``return_token_ids`` does), so a client of a
model without a tokenizer still gets its tokens. With ``return_token_ids`` the prompt's ids come
too, where vLLM puts them: on each completion choice (streamed: the first chunk of each), on the
chat response (streamed: the first chunk of each choice, its role chunk)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from moe_overlap.engine.loop import Delta
from moe_overlap.server.chat_answer import ChatAnswer
from moe_overlap.server.logprobs import Entry, TokenText, chat_logprobs, completion_logprobs
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
    cached_tokens: int = 0  # of those, found in the prefix cache
    entries: list[Entry] = field(default_factory=list)  # tokens with their logprobs
    started: bool = False
    last: str = ""  # the text the last delta added
    entries_before: int = 0  # where the last delta's entries start
    cumulative: float = 0.0  # the generated tokens' log-probabilities, summed (best_of)

    def add(self, delta: Delta, echo: tuple[list[int], str] | None = None) -> None:
        """Take a delta; the first one echoes the prompt (its text and log-probabilities)."""
        added = delta.text
        self.entries_before = len(self.entries)
        if echo is not None and not self.started:
            ids, prompt = echo
            added = prompt + added
            if delta.prompt_logprobs is not None:
                self.entries += zip(ids, delta.prompt_logprobs, strict=True)
        self.started = True
        self.text += added
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.entries += zip(delta.token_ids, delta.logprobs, strict=True)
            self.cumulative += sum(lp.logprob for lp in delta.logprobs)
        self.prompt_tokens, self.cached_tokens = delta.prompt_tokens, delta.cached_tokens
        if delta.finish_reason:
            self.finish_reason = FINISH_REASONS[delta.finish_reason]
        self.last = added


class Formatter:
    """The ids, timestamps and shapes of one call's responses (``chat`` or completion).
    ``echo``: per choice, the prompt's ids and text to put before its output; ``logprobs``:
    the choices carry their tokens' log-probabilities, written by ``token_text``."""

    def __init__(
        self,
        chat: bool,
        model: str,
        prompt_tokens: list[int],
        echo: list[tuple[list[int], str]] | None = None,
        logprobs: bool = False,
        token_text: TokenText | None = None,
        per_prompt: int = 1,
    ):
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens  # per prompt
        self.per_prompt = per_prompt  # choices (candidates) per prompt; echo is per choice
        self.echo, self.logprobs = echo, logprobs
        self.token_text = token_text or TokenText(None)
        self._streamed_chars: dict[int, int] = {}  # per choice: its token strings' length
        self.answer: ChatAnswer | None = None  # a chat's reasoning or tool calls, where asked
        self.continuous_usage = False  # vLLM's continuous_usage_stats: usage in every chunk
        self.prompt_ids: list[list[int]] | None = None  # per prompt, with return_token_ids
        self._ids_sent: set[int] = set()  # choices whose stream carried them

    def choices(self) -> list[Choice]:
        return [Choice() for _ in range(len(self.prompt_tokens) * self.per_prompt)]

    def add(self, choice: Choice, index: int, delta: Delta) -> None:
        choice.add(delta, None if self.echo is None else self.echo[index])

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

    def _logprobs(self, entries: list[Entry], offset: int) -> dict | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        return completion_logprobs(entries, self.token_text, offset)

    def whole(self, choices: list[Choice]) -> dict:
        per = len(choices) // len(self.prompt_tokens)  # n per prompt, best_of's already chosen
        body = []
        for i, c in enumerate(choices):
            reason = c.finish_reason
            if self.answer is not None:
                message, reason = self.answer.message(i, c.text, reason)
                out: dict = {"message": message}
            elif self.chat:
                out = {"message": {"role": "assistant", "content": c.text}}
            else:
                out = {"text": c.text}
            body.append(
                {
                    "index": i,
                    **out,
                    "finish_reason": reason,
                    "logprobs": self._logprobs(c.entries, 0),
                    "token_ids": c.token_ids,
                    **({} if self.chat else self._prompt_ids(i // per)),
                }
            )
        name = "chat.completion" if self.chat else "text_completion"
        whole = {**self._envelope(name, body), "usage": self.usage(choices)}
        return whole | (self._prompt_ids(0) if self.chat else {})

    def _prompt_ids(self, prompt: int, streamed: int | None = None) -> dict:
        """Prompt ``prompt``'s ``prompt_token_ids`` where ``return_token_ids`` asks for them;
        ``streamed``: the choice a chunk belongs to, which carries them on its first only."""
        if self.prompt_ids is None or streamed in self._ids_sent:
            return {}
        if streamed is not None:
            self._ids_sent.add(streamed)
        return {"prompt_token_ids": self.prompt_ids[prompt]}

    def chunk(self, index: int, delta: Delta | None, choice: Choice | None = None) -> str:
        """One streamed event: a delta of choice ``index`` (None: the chat's opening role),
        already added to ``choice``; it carries the entries that delta added (the echoed
        prompt's too, on the first)."""
        reason = FINISH_REASONS[delta.finish_reason] if delta and delta.finish_reason else None
        ids = delta.token_ids if delta else []
        text, offset, entries = "", 0, []
        if delta is not None and choice is not None:
            text = choice.last
            entries = choice.entries[choice.entries_before :]
            # offsets count the token strings (vLLM's rule), as the whole response's do
            offset = self._streamed_chars.get(index, 0)
            chars = sum(len(self.token_text(t)) for t, _ in entries)
            self._streamed_chars[index] = offset + chars
        if self.chat:
            part = {"content": text} if delta else {"role": "assistant", "content": ""}
            if self.answer is not None and delta is not None and choice is not None:
                part, reason = self.answer.delta(index, text, choice.text, reason)
            choice_body = {"index": index, "delta": part, "finish_reason": reason}
            logprobs = self._logprobs(entries, offset) if delta else None
            body = {**choice_body, "logprobs": logprobs, "token_ids": ids}
            return self._chunk_event("chat.completion.chunk", body, choice)
        body = {"index": index, "text": text, "finish_reason": reason, "token_ids": ids}
        logprobs = self._logprobs(entries, offset)
        body |= {"logprobs": logprobs, **self._prompt_ids(index // self.per_prompt, index)}
        return self._chunk_event("text_completion", body, choice)

    def _chunk_event(self, name: str, body: dict, choice: Choice | None) -> str:
        """A chunk of one choice; with ``continuous_usage`` it carries that choice's usage so
        far (vLLM's: its prompt's tokens and its own generated ones)."""
        envelope = self._envelope(name, [body])
        if self.chat:  # on the response, as vLLM's: each choice's first chunk carries them
            envelope |= self._prompt_ids(0, body["index"])
        if self.continuous_usage:
            prompt = self.prompt_tokens[body["index"] // self.per_prompt]
            completion = len(choice.token_ids) if choice is not None else 0
            usage = {"prompt_tokens": prompt, "completion_tokens": completion}
            envelope["usage"] = {**usage, "total_tokens": prompt + completion}
        return sse(envelope)

    def usage_chunk(self, choices: list[Choice]) -> str:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self._envelope(name, []), "usage": self.usage(choices)})
