"""Decode steps replayed from CUDA graphs (SGLang's ``--cuda-graph-max-bs`` and
``--disable-cuda-graph``).

A decode step launches a few hundred kernels that each run for microseconds, so on a GPU the
host's launches, not the GPU, bound it. A graph captured once replays the whole forward in one
launch. Graphs need fixed shapes and fixed memory, so:

- a batch runs in the graph of the smallest captured size that holds it (1, 2, 4, 8, then
  every 8), its rows past the batch padding that writes only the cache's scratch slot (the
  runner's last, which no sequence owns);
- a speculative target-verify step (k + 1 rows per sequence, every row's logits) has graphs of
  its own per size and k; each row runs as a decode row over its slot's keys up to its own
  position, which is the verify forward's causal mask (``graph_buckets.py``: the bucket
  choice, the padding and the staged rows, pure and tested on CPU). The drafts, their
  acceptance and the rollback stay on the host, outside the graph;
- keys are padded to a power of two (256 at least, up to ``max_len``) and masked per row;
- the inputs (ids, positions, slots; key counts follow from positions) are copied into the
  graph's own device buffers before each replay; the forward reads them there
  (``ForwardBatch.device_inputs``); a graph returns the logits and, where the MTP drafter
  needs them, every row's final hidden state;
- the KV cache and RoPE tables are allocated whole before the first capture (a buffer that
  grew later would move under the captured pointers);
- a graph is captured the first time its (size, key length, overlap) is met, after one warm-up
  run; graphs share one memory pool.

What the graph holds must never read the device from the host: the dispatch's counts stay on
the device, which the local backend's grouped GEMM allows (bf16 on sm90+, one rank). Every
other step runs eagerly, as before: prefill and mixed steps, other backends, linear-attention
layers (their state cache indexes by the host's slots), pipeline stages, PD multiplexing,
recorded steps, auto, SBO over the normal dispatch (SBO over the low-latency one is graphed),
and a low-latency step whose padded micro-batches would pass
``--num-max-dispatch-tokens-per-rank``.

TBO's micro-batches run one after the other on the capturing stream. DBO's run on two threads,
each launching on its own stream (``distributed/streams.py: MicroBatchStreams``), which fork
from the caller's stream and join it again, so the capture takes in both. A capture that
fails runs that bucket's forward eagerly from then on, with a warning: the capture itself
has run nothing.

With ``capture=False`` the same padded, buffer-fed forward runs eagerly instead of replaying:
the CPU tests check everything here but the capture itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.batch import ForwardBatch, most_tokens
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE
from moe_overlap.core.stage_io import ForwardOutputs
from moe_overlap.core.transfer import copy_to
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.expert_paths import grouped_fits
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.rope import RotaryEmbedding
from moe_overlap.runtime.graph_buckets import (
    Bucket,
    capture_batch,
    choose_bucket,
    graph_sizes,
    replay_of,
    staged_rows,
)

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    staged: torch.Tensor  # [3, rows] int64 on the device: ids, positions, slots
    replay: Callable[[], ForwardOutputs]  # the logits (and hidden states), in its own buffers
    mode: str  # the overlap mode its forward ran (TBO and DBO decline a batch too small)


class DecodeGraphs:
    """One runner's decode graphs. ``forward_eager`` is the runner's forward without graphs,
    ``mode_ran`` the overlap mode its last call ran; the cache's last slot is the scratch slot
    padding rows write."""

    def __init__(
        self,
        model: MoeForCausalLM,
        kv_cache: KVCache,
        forward_eager: Callable[[ForwardBatch, OverlapConfig], ForwardOutputs],
        max_bs: int,
        *,
        mode_ran: Callable[[], str],
        capture: bool = True,
        local: bool = True,
    ):
        """``local``: the runner dispatches on one rank (every decode step is graphed); else
        only its low-latency steps are."""
        self.kv_cache, self.forward_eager, self.capture = kv_cache, forward_eager, capture
        self.local = local
        self.mode_ran = mode_ran
        self.last_mode = NONE.name  # the mode the last replay's forward ran
        self.sizes = graph_sizes(max_bs)
        self.scratch = kv_cache.num_slots - 1
        self.device = kv_cache.device
        self.graphs: dict[tuple, _Graph] = {}
        self.fitting: dict[tuple, bool] = {}  # (bucket, cfg): its dispatches fit the capacity
        self.failed = 0  # buckets whose capture failed (they run eagerly)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared by all
        kv_cache.allocate_all()
        kv_cache.reserve([self.scratch], [1])  # the padding rows' scratch page(s)
        for m in model.modules():
            if isinstance(m, RotaryEmbedding):
                m.allocate(kv_cache.max_len)

    @staticmethod
    def supported(
        model: MoeForCausalLM, device: torch.device, dispatcher, low_latency: bool, *stages
    ) -> str | None:
        """Why ``model`` cannot decode from graphs here, or None. ``low_latency``: the runner
        can dispatch with fixed-capacity all-to-alls (then its low-latency steps are graphed);
        ``stages``: the runner's pipeline group and PD-mux lane, which rule graphs out."""
        if device.type != "cuda":
            return "CUDA graphs run on CUDA devices only"
        if not (dispatcher.name == Backend.LOCAL or low_latency) or any(
            s is not None for s in stages
        ):
            return (
                "the step communicates (tensor or pipeline parallel, PD-mux, attention TP) and "
                "its dispatch sizes its transfers on the host"
            )
        if model.state_shapes():
            return "linear-attention layers index their state cache from the host"
        for m in model.modules():
            if isinstance(m, ExpertBank):
                if m.w8a8 is not None and not m.w8a8.failed:
                    if not m.w8a8.grouped:
                        return "the FP8 experts run W8A8, one GEMM per expert sized on the host"
                    continue  # the grouped FP8 kernel reads the device's row ends
                weights = m.gate_up_proj
                if not grouped_fits(device, weights.dtype, (weights.shape[-1], m.intermediate)):
                    return "the experts do not run as one grouped GEMM (bf16 on sm90+)"
        return None

    def covers(
        self,
        peers: list[ForwardBatch],
        cfg: OverlapConfig,
        low_latency: bool,
        dispatch_rows: Callable[[list[ForwardBatch]], int] = most_tokens,
    ) -> bool:
        """Whether this step replays: every group's batch (``peers``, this rank's among them)
        decodes, verifies drafts (the same k in every group) or idles, and fits, the largest
        dispatch of its padded bucket (``dispatch_rows``: a micro-batch's under TBO or DBO)
        within the low-latency dispatch's capacity; the mode is one the graphs hold; and the
        dispatch is one the host never sizes (one rank's local dispatch, or this step's
        ``low_latency`` all-to-all). Every rank answers alike, so all replay or none does."""
        if not (MODES[cfg.mode].graphable(low_latency) and (self.local or low_latency)):
            return False
        fits = None
        if low_latency:

            def fits(bucket: Bucket) -> bool:
                if (bucket, cfg) not in self.fitting:
                    rows = torch.zeros(3, bucket.rows, dtype=torch.long)  # the host view only
                    largest = dispatch_rows([capture_batch(bucket, rows, self.scratch)])
                    self.fitting[bucket, cfg] = largest <= cfg.num_max_dispatch_tokens_per_rank
                return self.fitting[bucket, cfg]

        return choose_bucket(peers, self.sizes, self.kv_cache.max_len, fits) is not None

    def forward(
        self, batch: ForwardBatch, cfg: OverlapConfig, peers: list[ForwardBatch] | None = None
    ) -> ForwardOutputs:
        """``batch``'s logits (and hidden states) from the graph of the smallest bucket that
        holds every group's batch (``peers``): ranks that communicate replay, or capture, the
        same graph at the same step, so their collectives (and the votes a capture makes)
        always match."""
        bucket = choose_bucket(peers or [batch], self.sizes, self.kv_cache.max_len)
        if bucket is None:
            raise ValueError("no captured bucket holds this batch: ask covers() first")
        key = (bucket, cfg)
        if key not in self.graphs:
            self.kv_cache.reserve([self.scratch], [bucket.width])  # the padding rows' positions
            self.graphs[key] = self._capture(bucket, cfg)
        graph = self.graphs[key]
        self.kv_cache.reserve(batch.slots, batch.seq_lens)  # before the table is read
        copy_to(graph.staged, staged_rows(batch, bucket, self.scratch))
        self.last_mode = graph.mode
        out, rows = graph.replay(), batch.num_tokens
        # the graph's buffers are the next replay's too
        hidden = None if out.hidden is None else out.hidden[:rows].clone()
        return ForwardOutputs(logits=out.final_logits()[:rows].clone(), hidden=hidden)

    def _capture(self, bucket: Bucket, cfg: OverlapConfig) -> _Graph:
        staged = torch.zeros(3, bucket.rows, dtype=torch.long, device=self.device)
        staged[2].fill_(self.scratch)
        staged[1].copy_(torch.arange(bucket.width).repeat(bucket.size))
        batch = capture_batch(bucket, staged, self.scratch)

        def run() -> ForwardOutputs:
            return self.forward_eager(batch, cfg)

        side = torch.cuda.Stream(self.device) if self.capture else None
        if side is not None:  # warm up off the default stream, as torch asks
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # None: the current stream (CPU: no streams)
            run()  # the warm-up, which also tells the mode a replay will have run
        mode = self.mode_ran()
        if side is None:
            return _Graph(staged, run, mode)
        torch.cuda.current_stream(self.device).wait_stream(side)
        try:
            replay = replay_of(run, self.pool)
        except RuntimeError as error:  # a capture records and runs nothing: eager is safe
            self.failed += 1
            log.warning(
                "%d sequences of %d rows under %s run eagerly: their CUDA graph failed to "
                "capture (%s)",
                bucket.size,
                bucket.width,
                cfg.mode,
                error,
            )
            return _Graph(staged, run, mode)
        return _Graph(staged, replay, mode)
