"""Decode steps replayed from CUDA graphs (SGLang's ``--cuda-graph-max-bs`` and
``--disable-cuda-graph``).

A decode step launches a few hundred kernels that each run for microseconds, so on a GPU the
host's launches, not the GPU, bound it. A graph captured once replays the whole forward in one
launch. Graphs need fixed shapes and fixed memory, so:

- a batch runs in the graph of the smallest captured size that holds it (1, 2, 4, 8, then
  every 8), its rows past the batch padding that writes only the cache's scratch slot (the
  runner's last, which no sequence owns);
- keys are padded to a power of two (256 at least, up to ``max_len``) and masked per sequence;
- the inputs (ids, positions, slots; key counts follow from positions) are copied into the
  graph's own device buffers before each replay; the forward reads them there
  (``ForwardBatch.device_inputs``);
- the KV cache and RoPE tables are allocated whole before the first capture (a buffer that
  grew later would move under the captured pointers);
- a graph is captured the first time its (size, key length, overlap) is met, after one warm-up
  run; graphs share one memory pool.

What the graph holds must never read the device from the host: the dispatch's counts stay on
the device, which the local backend's grouped GEMM allows (bf16 on sm90+, one rank). Every
other step runs eagerly, as before: prefill and mixed steps, other backends, linear-attention
layers (their state cache indexes by the host's slots), pipeline stages, PD multiplexing,
recorded steps, and SBO and auto.

TBO's micro-batches run one after the other on the capturing stream. DBO's run on two threads,
each launching on its own stream (``distributed/streams.py: MicroBatchStreams``), which fork
from the caller's stream and join it again, so the capture takes in both. A capture that
fails runs that bucket's forward eagerly from then on, with a warning: the capture itself
has run nothing.

With ``capture=False`` the same padded, buffer-fed forward runs eagerly instead of replaying:
the CPU tests check everything here but the capture itself.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_overlap.core.a2a_mode import Backend
from moe_overlap.core.batch import DecodeInputs, ForwardBatch, ForwardMode
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE
from moe_overlap.core.transfer import copy_to
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.moe import ExpertBank, grouped_fits
from moe_overlap.model.rope import RotaryEmbedding

log = logging.getLogger(__name__)
MIN_KEYS = 256  # the shortest key bucket: shorter contexts pad up to it


def graph_sizes(max_bs: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, then every 8 up to ``max_bs`` (and it)."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sorted({*sizes, max_bs})


def key_bucket(length: int, max_len: int) -> int:
    """Keys a graph pads ``length`` to: the next power of two from ``MIN_KEYS``, at most
    ``max_len``."""
    return min(max_len, max(MIN_KEYS, 1 << (length - 1).bit_length()))


@dataclass
class _Graph:
    staged: torch.Tensor  # [3, size] int64 on the device: ids, positions, slots
    replay: Callable[[], torch.Tensor]  # the logits, in the graph's own buffer
    mode: str  # the overlap mode its forward ran (TBO and DBO decline a batch too small)


class DecodeGraphs:
    """One runner's decode graphs. ``forward_eager`` is the runner's forward without graphs,
    ``mode_ran`` the overlap mode its last call ran; the cache's last slot is the scratch slot
    padding rows write."""

    def __init__(
        self,
        model: MoeForCausalLM,
        kv_cache: KVCache,
        forward_eager: Callable[[ForwardBatch, OverlapConfig], torch.Tensor],
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
        self.failed = 0  # buckets whose capture failed (they run eagerly)
        self.pool = torch.cuda.graph_pool_handle() if capture else None  # shared by all
        kv_cache.allocate_all()
        kv_cache.reserve([self.scratch], [1])  # the padding rows' scratch page
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
                    return "the FP8 experts run W8A8, one GEMM per expert sized on the host"
                weights = m.gate_up_proj
                if not grouped_fits(device, weights.dtype, (weights.shape[-1], m.intermediate)):
                    return "the experts do not run as one grouped GEMM (bf16 on sm90+)"
        return None

    def covers(self, peers: list[ForwardBatch], cfg: OverlapConfig, low_latency: bool) -> bool:
        """Whether this step replays: every group's batch (``peers``, this rank's among them)
        decodes or idles, and fits; the mode is one the graphs hold; and the dispatch is one
        the host never sizes (one rank's local dispatch, or this step's ``low_latency``
        all-to-all). Every rank answers alike, so all replay or none does."""
        modes = {p.mode for p in peers}
        return (
            ForwardMode.DECODE in modes
            and modes <= {ForwardMode.DECODE, ForwardMode.IDLE}
            and max(p.num_seqs for p in peers) <= self.sizes[-1]
            and MODES[cfg.mode].graphable(low_latency)
            and (self.local or low_latency)
        )

    def forward(
        self, batch: ForwardBatch, cfg: OverlapConfig, peers: list[ForwardBatch] | None = None
    ) -> torch.Tensor:
        """``batch``'s logits from the graph of the smallest bucket that holds every group's
        batch (``peers``): ranks that communicate replay, or capture, the same graph at the
        same step, so their collectives (and the votes a capture makes) always match."""
        n, peers = batch.num_seqs, peers or [batch]
        size = self.sizes[bisect.bisect_left(self.sizes, max(p.num_seqs for p in peers))]
        longest = max(max(p.seq_lens, default=1) for p in peers)
        keys = key_bucket(longest, self.kv_cache.max_len)
        key = (size, keys, cfg)
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, keys, cfg)
        graph = self.graphs[key]
        pad = size - n  # padding rows: token 0 at position 0 of the scratch slot
        self.kv_cache.reserve(batch.slots, batch.seq_lens)  # before the table is read
        host = torch.tensor(
            [
                batch.input_ids.tolist() + [0] * pad,
                batch.prefix_lens + [0] * pad,  # a decode token's position
                batch.slots + [self.scratch] * pad,
            ],
            dtype=torch.long,
        )
        copy_to(graph.staged, host)
        self.last_mode = graph.mode
        return graph.replay()[:n].clone()  # the graph's buffer is the next replay's too

    def _capture(self, size: int, keys: int, cfg: OverlapConfig) -> _Graph:
        staged = torch.zeros(3, size, dtype=torch.long, device=self.device)
        staged[2].fill_(self.scratch)
        batch = ForwardBatch(
            torch.zeros(size, dtype=torch.long),
            [self.scratch] * size,
            [keys - 1] * size,  # the host's view: every sequence at the bucket's length
            [1] * size,
            is_decode=[True] * size,
            device_inputs=DecodeInputs(staged[0], staged[1], staged[2], keys),
        )

        def run() -> torch.Tensor:
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
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = run()
        except RuntimeError as error:  # a capture records and runs nothing: eager is safe
            self.failed += 1
            log.warning(
                "decode of %d sequences under %s runs eagerly: its CUDA graph failed to "
                "capture (%s)",
                size,
                cfg.mode,
                error,
            )
            return _Graph(staged, run, mode)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return _Graph(staged, replay, mode)
