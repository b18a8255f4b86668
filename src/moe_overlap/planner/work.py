"""What one rank's share of a micro-batch asks of attention: tokens, pieces, pairs, keys."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.model.layers import QUERY_BLOCK


@dataclass(frozen=True)
class Work:
    """One rank's share of one micro-batch."""

    tokens: int  # tokens through attention on this rank
    moe_tokens: float  # tokens this rank routes (attention TP scatters them)
    pieces: int  # sequences (or pieces of them)
    prefill_pieces: int  # of them not decoding (attention loops over these one by one)
    decode_tokens: int
    pairs: float  # query-key pairs attention computes
    keys: int  # cached keys read
    window_pairs: float = 0.0  # the same in a sliding layer (``window`` keys at most per query)
    window_keys: int = 0

    @classmethod
    def of(cls, batch: ForwardBatch, attn_tp: int, rectangle: bool, window: int = 0) -> Work:
        pairs, keys, decode, w_pairs, w_keys = 0.0, 0, 0, 0.0, 0
        for prefix, n, dec in zip(
            batch.prefix_lens, batch.extend_lens, batch.is_decode, strict=True
        ):
            full = rectangle and prefix > 0
            pairs += masked_pairs(prefix, n) if full else n * (prefix + (n + 1) / 2)
            keys += prefix + n
            decode += n if dec else 0
            if window:
                w_pairs += window_pairs(prefix, n, window)
                w_keys += min(prefix, window - 1) + n
        t = batch.num_tokens
        prefill = sum(not d for d in batch.is_decode)
        return cls(t, t / attn_tp, batch.num_seqs, prefill, decode, pairs, keys, w_pairs, w_keys)


def masked_pairs(prefix: int, new: int) -> int:
    """The query-key pairs the engine's masked attention computes for ``new`` queries after
    ``prefix`` keys: near-equal blocks of at most ``QUERY_BLOCK`` queries, each over the keys
    up to its own end (``model/layers.py: causal_attention``)."""
    parts = -(-new // QUERY_BLOCK)
    bounds = [new * i // parts for i in range(parts + 1)]
    return sum((b - a) * (prefix + b) for a, b in itertools.pairwise(bounds))


def window_pairs(prefix: int, new: int, window: int) -> int:
    """The query-key pairs the engine's sliding-window attention computes: blocks of at most
    ``QUERY_BLOCK`` queries, each over the keys from its first query's window to its end
    (``model/window_attention.py: extend_attention``)."""
    parts = max(1, -(-new // QUERY_BLOCK))
    bounds = [new * i // parts for i in range(parts + 1)]
    return sum(
        (b - a) * (prefix + b - max(0, prefix + a - window + 1))
        for a, b in itertools.pairwise(bounds)
    )
