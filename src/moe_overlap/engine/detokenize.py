"""Incremental detokenization of one request's output, with stop strings."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from tokenizers import decoders
from transformers import PreTrainedTokenizerFast

PENDING = "\ufffd"  # what a decoder gives for bytes that are not (yet) whole UTF-8


def window_decoder(tokenizer: PreTrainedTokenizerFast) -> Callable[[list[int]], str] | None:
    """A decode of the ids after a point where the text so far is whole UTF-8, whose text
    follows that text unchanged to make the whole output's; None where there is none.

    A byte-level decoder (GPT-2's, Qwen's, DeepSeek's) maps each token to bytes and their
    concatenation to text, so such a point cuts the text too. transformers' decode adds only
    the space clean-up, which looks across tokens: a tokenizer that asks for it, another
    decoder or a tokenizer class with its own decode is decoded whole on every token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    cls = type(tokenizer)
    if (
        cls.decode is not PreTrainedTokenizerFast.decode
        or cls._decode is not PreTrainedTokenizerFast._decode
    ):
        return None
    return partial(backend.decode, skip_special_tokens=True)


class TextStream:
    """The text of the tokens generated so far; ``push`` says when a stop string appeared.

    The text is cut before the first stop string. ``delta`` hands out only text that is final:
    not a byte sequence still incomplete in UTF-8, nor a tail that may be the start of a stop
    string. With a byte-level tokenizer each token decodes only the ids since the text was last
    whole UTF-8 (usually itself), so the cost per token does not grow with the output; the text
    equals decoding the whole output at once (``skip_special_tokens``), as it does otherwise.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, stop: list[str]):
        self.stop = stop
        self.reach = max(map(len, stop), default=1) - 1  # characters a stop string reaches back
        window = window_decoder(tokenizer)
        self._window = window is not None
        self._decode: Callable[[list[int]], str] = window or partial(
            tokenizer.decode, skip_special_tokens=True
        )
        self.ids: list[int] = []
        self._anchor = 0  # ids before it have their text for good (the head)
        self._head: list[str] = []  # that text in pieces, joined only when asked for
        self._head_len = 0
        self._head_end = ""  # its last ``reach`` characters, where a stop string may begin
        self._tail = ""  # the text of ids[anchor:], whose end may still change
        self._unsent: list[str] = []  # head text from ``_unsent_at`` on, for delta
        self._unsent_at = 0
        self._sent_end = ""  # the ``reach`` characters before ``_unsent_at``
        self.sent = 0  # characters already handed out by delta()
        self.stopped = False

    @property
    def text(self) -> str:
        return "".join(self._head) + self._tail

    def push(self, token_id: int, search: bool = True) -> bool:
        """Add a generated token; True when the text now holds a stop string.

        Only the new tail is searched: a stop string wholly inside the text already seen would
        have stopped the request then, so a match must end past it (cost per token: the stop
        strings' lengths, not the output's). ``search`` False: not yet (``min_tokens``, as
        vLLM and SGLang skip stop strings before it), so a match ending here is never found."""
        if self.stopped:
            return True
        self.ids.append(token_id)
        decoded = self._decode(self.ids[self._anchor :])
        tail = decoded if isinstance(decoded, str) else "".join(decoded)  # one id list: a str
        seen = _unchanged(self._tail, tail)
        self._tail = tail
        cut = self._find_stop(seen) if search else -1
        if cut >= 0:
            self._cut(cut)
        elif self._window and tail and not tail.endswith(PENDING):
            self._settle()
        return self.stopped

    def _find_stop(self, seen: int) -> int:
        """Where the first stop string ending past ``seen`` characters of the tail begins in
        the text, or -1."""
        if not self.stop:
            return -1
        back = min(self.reach - seen, len(self._head_end))  # head characters a match may use
        region = self._tail
        if back > 0:
            region = self._head_end[-back:] + region
        back = max(back, 0)
        cut = -1
        for s in self.stop:
            i = region.find(s, max(0, back + seen - len(s) + 1))
            at = i + self._head_len - back
            if i >= 0 and (cut < 0 or at < cut):
                cut = at
        return cut

    def _settle(self) -> None:
        """The tail is whole UTF-8: it joins the head, and later ids decode after it."""
        tail = self._tail
        self._head.append(tail)
        self._unsent.append(tail)
        self._head_len += len(tail)
        self._head_end = (self._head_end + tail)[-self.reach :] if self.reach else ""
        self._anchor, self._tail = len(self.ids), ""

    def _cut(self, cut: int) -> None:
        """End the text before the stop string at ``cut`` (the request ends here)."""
        text = self.text[:cut]
        self._head, self._head_len, self._tail = [text], cut, ""
        at = self._unsent_at = min(self._unsent_at, cut)
        self.sent = min(self.sent, cut)
        self._unsent, self._sent_end = [text[at:]], text[max(0, at - self.reach) : at]
        self._anchor, self.stopped = len(self.ids), True

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when ``final``)."""
        at = self._unsent_at
        pending = "".join(self._unsent) + self._tail  # the text from ``at`` on
        end = len(pending)
        if not final:
            while end > self.sent - at and pending[end - 1] == PENDING:  # bytes still to come
                end -= 1
            end -= held_back(self._sent_end + pending[:end], self.stop)
        end = max(end, self.sent - at)
        out = pending[self.sent - at : end]
        self.sent = at + end
        head = pending[: self._head_len - at]  # what stays: head text not handed out yet
        keep = min(end, len(head))
        self._sent_end = (self._sent_end + head[:keep])[-self.reach :] if self.reach else ""
        self._unsent, self._unsent_at = [head[keep:]], at + keep
        return out


def held_back(text: str, markers: list[str]) -> int:
    """How many trailing characters might begin one of ``markers`` (a stop string, a tag a
    parser waits for), so a stream holds them back until the next text decides."""
    held = 0
    for s in markers:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


def _unchanged(old: str, new: str) -> int:
    """How many leading characters of ``new`` were already in ``old``: all of ``old`` but its
    trailing replacement characters (bytes a later token may complete), if they agree."""
    keep = len(old)
    while keep and old[keep - 1] == PENDING:
        keep -= 1
    return keep if new.startswith(old[:keep]) else 0
