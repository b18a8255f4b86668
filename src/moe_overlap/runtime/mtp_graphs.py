"""The MTP drafter's steps replayed from CUDA graphs (SGLang's EAGLE draft and draft-extend
graphs, top-1). The first step is an extend over the rows each sequence kept (1 .. k + 1 after
a verify, as many as drafts were accepted); after a decode or verify step of w rows per
sequence it runs padded to w rows each (``MtpDrafter._padded``), every row's logits kept, and
the drafter reads each sequence's last kept row. Steps 2 .. ``steps`` are one decode row per
sequence through one MTP layer, the previous step's hidden state its input.

A step replays the graph of its (batch-size bucket, rows per sequence, key bucket, MTP layer),
with the target's graphs' rules (``graph_buckets.py``), over the rank's KV cache, which holds
the MTP layers' entries: padding sequences write only its scratch slot (its last, the target's
graphs' too), the ids, positions and slots are staged into the graph's buffers, and the hidden
states are copied into the graph's own input buffer. The picks (argmax, or a draw from q) stay
on the host, outside the graph. A first step after a prefill chunk (rows per sequence vary)
runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.transfer import copy_to
from moe_overlap.runtime.graph_buckets import (
    Bucket,
    capture_batch,
    choose_bucket,
    graph_sizes,
    replay_of,
    staged_rows,
)

log = logging.getLogger(__name__)
# one MTP forward of ``layer`` over a batch and its input hidden states: logits and hidden
DraftStep = Callable[[int, ForwardBatch, torch.Tensor], dict]


@dataclass
class _DraftGraph:
    staged: torch.Tensor  # [3, rows] int64 on the device: ids, positions, slots
    hidden: torch.Tensor  # [rows, hidden] the graph's input hidden states
    replay: Callable[[], dict]  # its logits and hidden states, in its own buffers


class DraftGraphs:
    """One drafter's MTP steps, per (bucket, layer). ``kv_cache``: the rank's, with the MTP
    layers' entries, whose last slot is the padding rows' scratch slot."""

    def __init__(self, kv_cache: KVCache, hidden_size: int, max_bs: int, *, capture: bool = True):
        self.kv_cache, self.hidden_size, self.capture = kv_cache, hidden_size, capture
        self.sizes = graph_sizes(max_bs)
        self.scratch = kv_cache.num_slots - 1
        self.graphs: dict[tuple[Bucket, int], _DraftGraph] = {}
        self.failed = 0  # graphs whose capture failed (they run eagerly)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        kv_cache.allocate_all()
        kv_cache.reserve([self.scratch], [1])

    def covers(self, batch: ForwardBatch) -> bool:
        """A one-token step, or a padded first step (every sequence ``width`` rows, every
        row's logits), of at most the largest size."""
        return self._bucket(batch) is not None

    def _bucket(self, batch: ForwardBatch) -> Bucket | None:
        return choose_bucket([batch], self.sizes, self.kv_cache.max_len)

    def forward(
        self, layer: int, batch: ForwardBatch, hidden: torch.Tensor, run: DraftStep
    ) -> dict:
        """MTP ``layer``'s logits and hidden states for ``batch`` (``hidden``: its input rows)
        from its graph; ``run`` is the eager step, which a first meeting captures."""
        bucket = self._bucket(batch)
        if bucket is None:
            raise ValueError("no captured bucket holds this batch: ask covers() first")
        key = (bucket, layer)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, layer, run, hidden.dtype)
        graph, n = self.graphs[key], batch.num_tokens
        self.kv_cache.reserve(batch.slots, batch.seq_lens)  # before the table is read
        copy_to(graph.staged, staged_rows(batch, bucket, self.scratch))
        graph.hidden[:n].copy_(hidden)
        out = graph.replay()
        return {"logits": out["logits"][:n].clone(), "hidden": out["hidden"][:n].clone()}

    def _capture(self, bucket: Bucket, layer: int, run: DraftStep, dtype) -> _DraftGraph:
        device = self.kv_cache.device
        self.kv_cache.reserve([self.scratch], [bucket.width])  # the padding rows' positions
        staged = torch.zeros(3, bucket.rows, dtype=torch.long, device=device)
        staged[2].fill_(self.scratch)
        staged[1].copy_(torch.arange(bucket.width).repeat(bucket.size))
        hidden = torch.zeros(bucket.rows, self.hidden_size, dtype=dtype, device=device)
        batch = capture_batch(bucket, staged, self.scratch)

        def step() -> dict:
            return run(layer, batch, hidden)

        if not self.capture:
            return _DraftGraph(staged, hidden, step)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # the warm-up, off the default stream
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        try:
            replay = replay_of(step, self.pool)
        except RuntimeError as error:  # a capture records and runs nothing: eager is safe
            self.failed += 1
            log.warning(
                "MTP steps of %d sequences run eagerly: their CUDA graph failed to capture (%s)",
                bucket.size,
                error,
            )
            return _DraftGraph(staged, hidden, step)
        return _DraftGraph(staged, hidden, replay)
