"""Which CUDA graph a decode or target-verify step replays, and what its device buffers hold:
pure functions of the host's batches, so the CPU tests check every choice a GPU makes.

A graph holds ``size`` sequences of ``width`` rows each (1 for decode; k + 1 for a verify step
with k drafts per sequence, SGLang's ``num_tokens_per_bs``) over keys padded to ``keys``. A
batch takes the smallest size that holds every data-parallel group's sequences; its missing
sequences are padding, ``width`` rows each at positions ``0 .. width - 1`` of the scratch slot
(the cache's last, which no sequence owns). Every row is staged as a decode row of its own: its
token, its position and its sequence's slot, so row j of a verify sequence attends over the
keys up to its own position, which is the verify forward's causal mask.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from moe_overlap.core.batch import DecodeInputs, ForwardBatch, ForwardMode

MIN_KEYS = 256  # the shortest key bucket: shorter contexts pad up to it
_GRAPHED = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


def graph_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to ``max_bs`` (and it)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sorted({*sizes, max_bs})


def key_bucket(length: int, max_len: int) -> int:
    """Keys a graph pads ``length`` to: the next power of two from ``MIN_KEYS``, at most
    ``max_len``."""
    return min(max_len, max(MIN_KEYS, 1 << (length - 1).bit_length()))


@dataclass(frozen=True)
class Bucket:
    """One captured graph's shape: ``size`` sequences of ``width`` rows over ``keys`` keys."""

    size: int
    width: int
    keys: int

    @property
    def rows(self) -> int:
        return self.size * self.width


def rows_per_seq(batches: Sequence[ForwardBatch]) -> int | None:
    """The rows per sequence every non-idle batch has (1: decode, k + 1: verify with every
    row's logits), or None: a batch prefills, or the groups' widths differ (no one graph
    holds the step)."""
    widths = set()
    for batch in batches:
        if batch.mode == ForwardMode.IDLE:
            continue
        if batch.mode not in _GRAPHED or len(set(batch.extend_lens)) != 1:
            return None
        if batch.mode == ForwardMode.TARGET_VERIFY and not all(batch.all_logits):
            return None
        widths.add(batch.extend_lens[0])
    return widths.pop() if len(widths) == 1 else None


def choose_bucket(
    peers: Sequence[ForwardBatch],
    sizes: Sequence[int],
    max_len: int,
    fits: Callable[[Bucket], bool] | None = None,
) -> Bucket | None:
    """The graph that holds every group's batch (``peers``), or None: it runs eagerly (a
    prefill, groups of different widths, more sequences than the largest size, or a bucket
    that ``fits`` refuses: one whose padded micro-batches would pass the low-latency
    dispatch's ``--num-max-dispatch-tokens-per-rank``)."""
    width = rows_per_seq(peers)
    if width is None:
        return None
    at = bisect.bisect_left(sizes, max(p.num_seqs for p in peers))
    if at == len(sizes):
        return None
    longest = max(max(p.seq_lens, default=1) for p in peers)
    bucket = Bucket(sizes[at], width, key_bucket(longest, max_len))
    if fits is not None and not fits(bucket):
        return None
    return bucket


def staged_rows(batch: ForwardBatch, bucket: Bucket, scratch: int) -> torch.Tensor:
    """``[3, bucket.rows]`` int64 on the host: each row's token, position and slot, the
    batch's rows first, then the padding sequences' (token 0 at positions ``0 .. width - 1``
    of the ``scratch`` slot)."""
    pad = bucket.size - batch.num_seqs
    slots = [s for s in batch.slots for _ in range(bucket.width)]
    return torch.tensor(
        [
            batch.input_ids.tolist() + [0] * (pad * bucket.width),
            batch.positions.tolist() + list(range(bucket.width)) * pad,
            slots + [scratch] * (pad * bucket.width),
        ],
        dtype=torch.long,
    )


def capture_batch(bucket: Bucket, staged: torch.Tensor, scratch: int) -> ForwardBatch:
    """The batch a graph is captured on: its rows read from ``staged`` (``[3, rows]`` on the
    device), its host view ``size`` sequences of ``width`` rows ending at the bucket's key
    count (what the overlap schemes' votes and splits see)."""
    width = bucket.width
    return ForwardBatch(
        torch.zeros(bucket.rows, dtype=torch.long),
        [scratch] * bucket.size,
        [bucket.keys - width] * bucket.size,
        [width] * bucket.size,
        all_logits=[width > 1] * bucket.size,
        is_decode=[True] * bucket.size,
        device_inputs=DecodeInputs(staged[0], staged[1], staged[2], bucket.keys),
    )


T = TypeVar("T")


def replay_of(run: Callable[[], T], pool) -> Callable[[], T]:
    """``run`` (already warmed up) captured into a CUDA graph in ``pool``, as a function that
    replays it and returns the captured outputs (the graph's buffers, the next replay's too).
    A capture that fails raises ``RuntimeError`` having recorded and run nothing, so the
    caller can run ``run`` eagerly instead."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()

    def replay() -> T:
        graph.replay()
        return outputs

    return replay
