"""Calibrate the overlap predictor on this model, these ranks and this link (a short warm-up).

Every rank runs the same synthetic batches in the same order, into a scratch KV cache (the
engine's own cache holds live sequences): plain forwards of a few shapes fit compute (seconds
per FLOP, per sequence and per pass) and communication (latency and rate) from the timeline;
then each candidate mode runs once and its measured time over the prediction is its starting
factor. The fits are averaged and the times maxed over ranks, so every rank holds the same
calibration and takes the same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.core.state_cache import StateCache
from moe_overlap.distributed.groups import Group
from moe_overlap.overlap.operations import execute_operations
from moe_overlap.overlap.predict import Calibration, StepStats, raw_times
from moe_overlap.overlap.split import whole

SHAPES = ((1, 128), (1, 384), (1, 768), (48, 4))  # (sequences, tokens each), from position 0
MODE_SHAPE = (1, 768)  # where each mode's starting factor is measured


@dataclass
class ScratchRunner:
    """The runner's model, dispatcher and timeline over a scratch KV cache."""

    runner: object
    kv_cache: KVCache
    states: StateCache | None = None  # a scratch recurrent-state cache (hybrid models)

    def __post_init__(self) -> None:
        kv = self.kv_cache
        shapes = self.runner.model.state_shapes()
        self.states = StateCache(shapes, kv.num_slots, kv.dtype, kv.device)

    @property
    def ops(self) -> list:
        return self.runner.ops

    def context(self, batch: ForwardBatch, name: str = "mb0") -> ForwardContext:
        r = self.runner
        return ForwardContext(
            batch, self.kv_cache, r.dispatcher, name=name, timeline=r.timeline, states=self.states
        )


def shape_batch(seqs: int, tokens: int, vocab: int) -> ForwardBatch:
    ids = torch.randint(vocab, (seqs * tokens,), generator=torch.Generator().manual_seed(seqs))
    return ForwardBatch(ids, list(range(seqs)), [0] * seqs, [tokens] * seqs)


def _fit(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares, each column scaled to unit size first (FLOPs dwarf sequence counts)."""
    x = torch.tensor(xs, dtype=torch.float64)
    scale = x.abs().amax(dim=0).clamp_min(1e-30)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    return (torch.linalg.lstsq(x / scale, y).solution[:, 0] / scale).tolist()


def calibrate(
    runner, group: Group, sbo_blocks: int, run_mode: Callable[[str, ForwardBatch, object], None]
) -> Calibration:
    """``run_mode(mode, batch, scratch_runner)`` runs one forward of ``batch`` in ``mode``."""
    model, cfg = runner.model, runner.model.cfg
    cost = ModelFlops.for_model(cfg)
    layers = cfg.num_hidden_layers
    kv = runner.kv_cache  # the scratch caches sit where the real one does
    caches = {
        s: KVCache(layers, s[0], s[1], model.kv_entries(), kv.dtype, kv.device) for s in SHAPES
    }
    timeline = runner.timeline
    saved, was = timeline.spans, timeline.enabled
    timeline.spans, timeline.enabled = [], True
    try:
        compute, comm = [], []
        for shape in SHAPES:
            batch = shape_batch(*shape, cfg.vocab_size)
            scratch = ScratchRunner(runner, caches[shape])
            execute_operations(scratch.context(batch), runner.ops)  # warm
            timeline.take()
            start = time.perf_counter()
            execute_operations(scratch.context(batch), runner.ops)
            wall = time.perf_counter() - start
            spans = timeline.take()
            waits = sum(s.end - s.start for s in spans if s.track.endswith(" wait"))
            flops = cost.cost(batch, whole(batch))
            compute.append(([flops, shape[0], 1.0], wall - waits))
            comm += [(batch.num_tokens, s.end - s.start) for s in spans if s.track == "comm"]
        kappa, per_seq, per_pass = _fit([x for x, _ in compute], [y for _, y in compute])
        latency, per_token_s = (
            _fit([[1.0, t] for t, _ in comm], [d for _, d in comm]) if comm else (0.0, 0.0)
        )
        fitted = torch.tensor([kappa, per_seq, per_pass, latency, per_token_s], dtype=torch.float64)
        if group.size > 1:
            fitted = group.all_reduce(fitted) / group.size
        kappa, per_seq, per_pass, latency, per_token_s = fitted.tolist()
        bytes_per_token = _bytes_per_token(cfg, group.size, next(model.parameters()).element_size())
        cal = Calibration(
            kappa=max(kappa, 1e-15),
            per_seq=max(per_seq, 0.0),
            per_pass=max(per_pass, 0.0),
            latency=max(latency, 0.0),
            bytes_per_s=bytes_per_token / per_token_s if per_token_s > 0 else float("inf"),
            bytes_per_token=bytes_per_token,
            moe_layers=sum(cfg.is_moe_layer(i) for i in range(layers)),
            expert_share=cost.expert_share,
            shared_share=cost.shared_share,
            sbo_blocks=sbo_blocks,
        )
        _measure_factors(cal, runner, group, caches[MODE_SHAPE], cost, run_mode)
        return cal
    finally:
        timeline.spans, timeline.enabled = saved, was


def _measure_factors(cal, runner, group, cache, cost, run_mode) -> None:
    batch = shape_batch(*MODE_SHAPE, runner.model.cfg.vocab_size)
    flops = cost.cost(batch, whole(batch))
    stats = StepStats(
        [flops] * group.size,
        [batch.num_tokens] * group.size,
        [batch.num_seqs] * group.size,
        True,
        batch.num_tokens // 2,
    )
    raw = raw_times(cal, stats)
    modes = list(cal.factor)
    measured = torch.zeros(len(modes), dtype=torch.float64)
    for i, mode in enumerate(modes):
        start = time.perf_counter()
        run_mode(mode, batch, ScratchRunner(runner, cache))
        measured[i] = time.perf_counter() - start
    if group.size > 1:
        measured = group.all_reduce(measured, op=dist.ReduceOp.MAX)
    for mode, seconds in zip(modes, measured.tolist(), strict=True):
        cal.factor[mode] = min(max(seconds / raw[mode], 0.25), 4.0)


def _bytes_per_token(cfg: ModelConfig, ep: int, element_size: int) -> float:
    """Expected bytes one rank sends per token in one all-to-all: its top-k rows, the share
    (ep - 1) / ep of which go to other ranks under uniform routing."""
    return cfg.num_experts_per_tok * cfg.hidden_size * element_size * (ep - 1) / ep
