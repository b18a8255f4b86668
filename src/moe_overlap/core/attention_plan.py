"""Where one forward's tokens go in the KV cache and how attention runs over them: index
tensors built once per forward (by its first attention layer) and read by every layer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.transfer import to_device

# --attention-backend (SGLang's flag): how decode attention reads the paged KV cache.
# torch_native: each row's keys gathered into a contiguous tensor, then SDPA; flex_attention:
# FlexAttention over the pool with a block mask of each row's pages (model/flex_decode.py)
ATTENTION_BACKENDS = ("torch_native", "flex_attention")
GPU_PAGE_MULTIPLE = 16  # flex_attention on a GPU: a page holds whole key tiles of 16 or more


@dataclass
class ExtendGroup:
    """Sequences that extend by the same ``new`` tokens after the same ``prefix`` cached ones:
    one batched attention call with one causal mask."""

    prefix: int
    new: int
    slots: torch.Tensor | slice  # their cache slots, a slice when consecutive (no copy)
    rows: torch.Tensor | slice  # their token rows, sequence after sequence

    @property
    def length(self) -> int:
        return self.prefix + self.new


@dataclass
class AttentionPlan:
    """Where one forward's tokens go in the KV cache and how attention runs over them.

    Sequences with one new token (decode steps) attend in one batched call over their cached
    rows padded to the longest; longer extends (prefill chunks) in one call per group of
    equal prefix and length (a batch of fresh prompts of one length is one call).
    """

    slots: torch.Tensor  # [T] the cache slot of every new token
    decode_rows: torch.Tensor  # [B] the token row of each one-token sequence
    decode_slots: torch.Tensor | slice  # [B], or a slice when they are consecutive (no copy)
    decode_lens: torch.Tensor | None  # [B] keys each attends over; None: all decode_max_len
    decode_max_len: int
    decode_min_len: int  # the shortest: a sliding window's decode reads from its first key
    extends: list[ExtendGroup]
    all_decode: bool  # every token is a decode row, in batch order
    # the decode rows' key masks, per padded key count: built by the first layer, reused
    _decode_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # --attention-backend flex_attention: the decode rows' block mask over the page pool
    # (model/flex_decode.py), built by the first layer, like the above
    decode_block_mask: object | None = field(default=None, init=False, repr=False)
    # one forward's block-table lookups (``KVCache.store``'s places for the new tokens,
    # ``KVCache.gather``'s pages for each read), made by the first layer, read by the others
    pages: dict = field(default_factory=dict, init=False, repr=False)
    # the extends' lower-right causal masks, per (queries, keys): built once, like the above
    causal_masks: dict[tuple[int, int], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    def decode_mask(self, keys: int) -> torch.Tensor | None:
        """Which of ``keys`` padded keys each decode row sees, ``[B, 1, 1, keys]`` (SDPA's key
        padding mask); None when every row sees them all (no mask: the faster kernel)."""
        lens = self.decode_lens
        if lens is None:
            return None
        if keys not in self._decode_masks:
            seen = torch.arange(keys, device=lens.device) < lens[:, None]
            self._decode_masks[keys] = seen[:, None, None, :]
        return self._decode_masks[keys]

    @classmethod
    def of(cls, batch: ForwardBatch, device: torch.device | str = "cpu") -> AttentionPlan:
        """The plan of ``batch``, its index tensors on ``device`` (the KV cache's)."""
        staged = batch.device_inputs
        if staged is not None:  # decode rows in device buffers: every key count is masked
            return cls(
                slots=staged.slots,
                decode_rows=torch.arange(0),  # unread: every row is a decode row
                decode_slots=staged.slots,
                decode_lens=staged.positions + 1,  # keys each attends over
                decode_max_len=staged.max_len,
                decode_min_len=1,  # a padding row's; a window then reads from key 0, masked
                extends=[],
                all_decode=True,
            )
        rows, slots, lens = [], [], []
        groups: dict[tuple[int, int], list[tuple[int, slice]]] = {}
        for slot, prefix, span in batch.per_sequence():
            if span.stop - span.start == 1:
                rows.append(span.start)
                slots.append(slot)
                lens.append(prefix + 1)
            else:
                groups.setdefault((prefix, span.stop - span.start), []).append((slot, span))

        def longs(items: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(items, dtype=torch.long), device)

        def token_rows(spans: list[slice]) -> torch.Tensor | slice:
            if all(a.stop == b.start for a, b in itertools.pairwise(spans)):
                return slice(spans[0].start, spans[-1].stop)
            return longs([i for span in spans for i in range(span.start, span.stop)])

        extends = [
            ExtendGroup(
                prefix,
                new,
                _as_slice([slot for slot, _ in members]) or longs([slot for slot, _ in members]),
                token_rows([span for _, span in members]),
            )
            for (prefix, new), members in groups.items()
        ]
        return cls(
            slots=longs(
                [s for s, n in zip(batch.slots, batch.extend_lens, strict=True) for _ in range(n)]
            ),
            decode_rows=longs(rows),
            decode_slots=_as_slice(slots) or longs(slots),
            decode_lens=longs(lens) if len(set(lens)) > 1 else None,  # equal: no mask
            decode_max_len=max(lens, default=0),
            decode_min_len=min(lens, default=0),
            extends=extends,
            all_decode=not extends,
        )


def _as_slice(items: list[int]) -> slice | None:
    """``slice(a, a + n)`` if ``items`` are ``a, a + 1, ..., a + n - 1``, else None."""
    if items and items == list(range(items[0], items[0] + len(items))):
        return slice(items[0], items[0] + len(items))
    return None


# A query block's share of a chunk that attends over a prefix: SDPA's masked path works through
# every (query, key) pair of its rectangle, so a long chunk attends block by block, each over the
# keys up to its own end; the block size is the best of those tried (docs/tuning.md).
