"""Log-probabilities in OpenAI's two shapes: the completions API's legacy columns (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and chat's ``content`` list.

A token's string is the tokenizer's decoding of that id alone (``token_id:N`` without a
tokenizer, as vLLM writes it), the same in ``tokens`` and in the keys of ``top_logprobs``, so a
client can tell whether the chosen token was the likeliest (lm-eval's ``is_greedy``).
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_overlap.engine.request import TokenLogprobs

# (token id, its log-probabilities); None for a prompt's first token, which nothing predicts
Entry = tuple[int, TokenLogprobs | None]


class TokenText:
    """Token ids as the strings a client sees."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._cache:
            if self.tokenizer is None:
                self._cache[token_id] = f"token_id:{token_id}"
            else:
                self._cache[token_id] = self.tokenizer.decode([token_id])
        return self._cache[token_id]


def completion_logprobs(entries: Sequence[Entry], text: TokenText, offset: int) -> dict:
    """The completions API's ``logprobs`` object; ``text_offset`` counts the token strings
    from ``offset`` (the length of those before these, streamed)."""
    tokens = [text(t) for t, _ in entries]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in entries],
        "top_logprobs": [None if lp is None else _top_dict(lp, text) for _, lp in entries],
        "text_offset": offsets,
    }


def _top_dict(lp: TokenLogprobs, text: TokenText) -> dict[str, float]:
    """The chosen token and the top alternatives, keyed by their strings (OpenAI includes the
    chosen one even when it is not among the top k). Tokens that read the same (bytes of no
    whole character all read "\ufffd") share a key, which holds the likeliest one's value."""
    top: dict[str, float] = {}
    for t, value in [*lp.top, (lp.token_id, lp.logprob)]:
        top[text(t)] = max(value, top.get(text(t), value))
    return top


def chat_logprobs(entries: Sequence[Entry], text: TokenText) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    return {
        "content": [
            {
                **_chat_token(t, lp.logprob, text),
                "top_logprobs": [_chat_token(u, value, text) for u, value in lp.top],
            }
            for t, lp in entries
            if lp is not None
        ]
    }


def _chat_token(token_id: int, logprob: float, text: TokenText) -> dict:
    token = text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
