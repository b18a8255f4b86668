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
        """Add a generated token; True when the text now holds a stop string.

        Only the new tail is searched: a stop string wholly inside the text already seen would
        have stopped the request then, so a match must end past it (cost per token: the stop
        strings' lengths, not the output's)."""
        self.ids.append(token_id)
        decoded = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        text = decoded if isinstance(decoded, str) else "".join(decoded)  # one id list: a str
        seen = _unchanged(self.text, text)
        cut = -1
        for s in self.stop:
            i = text.find(s, max(0, seen - len(s) + 1))
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
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


def _unchanged(old: str, new: str) -> int:
    """How many leading characters of ``new`` were already in ``old``: all of ``old`` but its
    trailing replacement characters (bytes a later token may complete), if they agree."""
    keep = len(old)
    while keep and old[keep - 1] == "\ufffd":
        keep -= 1
    return keep if new.startswith(old[:keep]) else 0
