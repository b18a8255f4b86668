"""One forward pass worth of sequences: what attention, the MoE and the overlap engine see."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeInputs:
    """A decode or target-verify batch's inputs already on the device, one entry per token
    row: the static buffers a CUDA graph was captured on (``runtime/cuda_graphs.py``). Every
    row attends as a decode row over its slot's keys up to its own position (a verify
    sequence's k + 1 rows: its causal mask). The forward reads them instead of sending the
    batch's host lists; ``max_len`` bounds every sequence's length (the attention's padded key
    count, RoPE's and the cache's bound)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] = the sequence's length before this token
    slots: torch.Tensor  # [T] KV cache slots (a verify sequence's, once per row)
    max_len: int

    def rows(self, start: int, stop: int) -> DecodeInputs:
        """Token rows ``start .. stop - 1``: views, so a micro-batch reads the same buffers."""
        cut = slice(start, stop)
        return DecodeInputs(self.input_ids[cut], self.positions[cut], self.slots[cut], self.max_len)


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill (possibly a later chunk of a prompt)
    DECODE = "decode"  # one new token per sequence
    MIXED = "mixed"  # prefill chunks and decode tokens together
    # speculative decoding: each sequence feeds its last token and k draft tokens (k + 1 rows),
    # every row's logits scored; split, voted and scheduled as decode is
    TARGET_VERIFY = "target_verify"
    IDLE = "idle"  # no tokens on this rank; it still joins every collective


@dataclass
class ForwardBatch:
    """Sequences of one forward pass on one rank.

    Sequence i contributes ``extend_lens[i]`` new tokens at positions
    ``prefix_lens[i] .. prefix_lens[i] + extend_lens[i] - 1``; attention writes their K/V into
    cache row ``slots[i]`` and attends over ``[0, seq_len)``. A decode token is an extend of one.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    # Per sequence: True if it needs logits for every new token, else only for its last one.
    all_logits: list[bool] = field(default_factory=list)
    # Per sequence: True if its last token is a decode step (for the mode and split policies).
    is_decode: list[bool] = field(default_factory=list)
    # a decode batch whose inputs sit in device buffers already (a CUDA graph's); never pickled
    device_inputs: DecodeInputs | None = None

    def __post_init__(self) -> None:
        n = len(self.slots)
        if not self.all_logits:
            self.all_logits = [False] * n
        if not self.is_decode:
            self.is_decode = [False] * n
        if not (len(self.prefix_lens) == len(self.extend_lens) == len(self.all_logits) == n):
            raise ValueError("slots, prefix_lens, extend_lens and all_logits differ in length")
        if sum(self.extend_lens) != self.input_ids.numel():
            raise ValueError(
                f"input_ids has {self.input_ids.numel()} tokens but extend_lens sum to "
                f"{sum(self.extend_lens)}"
            )

    @classmethod
    def idle(cls) -> ForwardBatch:
        return cls(torch.zeros(0, dtype=torch.long), [], [], [])

    @property
    def mode(self) -> ForwardMode:
        if not self.slots:
            return ForwardMode.IDLE
        if all(self.is_decode):
            return ForwardMode.DECODE if self.token_num_per_seq == 1 else ForwardMode.TARGET_VERIFY
        return ForwardMode.MIXED if any(self.is_decode) else ForwardMode.EXTEND

    @property
    def decodes(self) -> bool:
        """A decode or target-verify batch: the decode strategy, votes and split rules."""
        return self.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)

    @property
    def token_num_per_seq(self) -> int:
        """SGLang's ``token_num_per_seq``: rows per sequence of a verify batch (its draft
        tokens and the last token), 1 in decode."""
        return max(self.extend_lens, default=1)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def positions(self) -> torch.Tensor:
        if all(e == 1 for e in self.extend_lens):  # decode: each token at its prefix length
            return torch.tensor(self.prefix_lens, dtype=torch.long)
        lens, total = torch.tensor(self.extend_lens), sum(self.extend_lens)
        starts = torch.tensor(self.prefix_lens) - (torch.cumsum(lens, 0) - lens)
        return torch.arange(total) + torch.repeat_interleave(starts, lens, output_size=total)

    def per_sequence(self):
        """``(slot, prefix_len, rows)`` of each sequence; ``rows`` slices its new tokens."""
        start = 0
        for slot, prefix, n in zip(self.slots, self.prefix_lens, self.extend_lens, strict=True):
            yield slot, prefix, slice(start, start + n)
            start += n

    @property
    def every_row_is_a_logit_row(self) -> bool:
        """One logit row per token, in order (a decode batch): no rows to pick."""
        return all(
            n == 1 or every for n, every in zip(self.extend_lens, self.all_logits, strict=True)
        )

    def logit_rows(self) -> torch.Tensor:
        """Indices of the tokens whose logits this forward returns, in sequence order."""
        rows: list[int] = []
        start = 0
        for n, every in zip(self.extend_lens, self.all_logits, strict=True):
            rows.extend(range(start, start + n) if every else [start + n - 1])
            start += n
        return torch.tensor(rows, dtype=torch.long)

    def __reduce__(self):  # pickled as plain lists: no tensor storage crosses processes
        return (ForwardBatch.from_dict, (self.to_dict(),))

    def to_dict(self) -> dict:
        """A picklable form for broadcasting to other ranks."""
        return {
            "input_ids": self.input_ids.tolist(),
            "slots": self.slots,
            "prefix_lens": self.prefix_lens,
            "extend_lens": self.extend_lens,
            "all_logits": self.all_logits,
            "is_decode": self.is_decode,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ForwardBatch:
        return cls(
            torch.tensor(d["input_ids"], dtype=torch.long),
            d["slots"],
            d["prefix_lens"],
            d["extend_lens"],
            d["all_logits"],
            d["is_decode"],
        )


def most_tokens(batches: Sequence[ForwardBatch]) -> int:
    """The largest batch's tokens (0 for none): what one dispatch of an unsplit step carries
    on the busiest rank."""
    return max((b.num_tokens for b in batches), default=0)
