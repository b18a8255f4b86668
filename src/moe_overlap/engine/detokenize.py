"""Incremental detokenization of one request's output, with stop strings."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


class TextStream:
    """The text of the tokens generated so far; ``push`` says when a stop string appeared.

    The text is cut before the first stop string. ``delta`` hands out only text that is final:
    not a byte sequence still incomplete in UTF-8, nor a tail that may be the start of a stop
    string.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters already handed out by delta()
        self.stopped = False

    def push(self, token_id: int) -> bool:
        """Add a generated token; True when the text now holds a stop string."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
        else:
            self.text = text
        return self.stopped

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when ``final``)."""
        end = len(self.text)
        if not final:
            while end > self.sent and self.text[end - 1] == "\ufffd":  # bytes still to come
                end -= 1
            end -= _held_for_stop(self.text[:end], self.stop)
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


def _held_for_stop(text: str, stop: list[str]) -> int:
    """How many trailing characters might begin a stop string."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held
