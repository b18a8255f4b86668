"""Calibrate the overlap predictor on this model, these ranks and this link (a short warm-up).

Every rank runs the same synthetic batches in the same order, into a scratch KV cache (the
engine's own cache holds live sequences): plain forwards of a few shapes fit compute (seconds
per FLOP, per sequence and per pass) and communication (latency and rate) from the timeline,
with the fit ``plan --cluster this`` uses too (``core/cost_fit.py``); then each candidate mode
runs once and its measured time over the prediction is its starting factor. The fits are
averaged and the times maxed over ranks, so every rank holds the same calibration and takes the
same decisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.cost_fit import LinkFit, fit_costs, fit_link
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.distributed.groups import Group
from moe_overlap.model.caches import kv_cache_for, state_cache_for
from moe_overlap.overlap.operations import execute_operations
from moe_overlap.overlap.predict import Calibration, StepStats, raw_times
from moe_overlap.overlap.scheme import Runner
from moe_overlap.overlap.split import whole

SHAPES = ((1, 128), (1, 384), (1, 768), (48, 4))  # (sequences, tokens each), from position 0
MODE_SHAPE = (1, 768)  # where each mode's starting factor is measured


RunMode = Callable[[str, ForwardBatch, Runner], None]  # one forward of a batch in a mode


class ScratchRunner:
    """The rank's runner (its model, ops, dispatcher and timeline) over scratch caches, sized
    as the runner sizes its own (``model/caches.py``): a ``Runner``."""

    def __init__(self, runner: Runner, kv_cache: KVCache) -> None:
        self.model, self.ops, self.timeline = runner.model, runner.ops, runner.timeline
        self.dispatcher = runner.dispatcher
        self.kv_cache = kv_cache
        self.states = state_cache_for(self.model, kv_cache.num_slots)  # hybrid models' states

    def context(self, batch: ForwardBatch, name: str = tracks.FIRST) -> ForwardContext:
        return ForwardContext(
            batch,
            self.kv_cache,
            self.dispatcher,
            name=name,
            timeline=self.timeline,
            states=self.states,
        )


def shape_batch(seqs: int, tokens: int, vocab: int) -> ForwardBatch:
    ids = torch.randint(vocab, (seqs * tokens,), generator=torch.Generator().manual_seed(seqs))
    return ForwardBatch(ids, list(range(seqs)), [0] * seqs, [tokens] * seqs)


def calibrate(runner: Runner, group: Group, sbo_blocks: int, run_mode: RunMode) -> Calibration:
    """``run_mode(mode, batch, scratch_runner)`` runs one forward of ``batch`` in ``mode``."""
    model, cfg = runner.model, runner.model.cfg
    cost = ModelFlops.for_model(cfg)
    layers = cfg.num_hidden_layers
    caches = {shape: kv_cache_for(model, *shape) for shape in SHAPES}  # (slots, max_len)
    timeline = runner.timeline
    saved, was = timeline.spans, timeline.enabled
    timeline.spans, timeline.enabled = [], True
    bytes_per_token = _bytes_per_token(cfg, group.size, next(model.parameters()).element_size())
    try:
        compute: list[tuple[list[float], float]] = []  # ([FLOPs, sequences, 1], seconds)
        comm: list[tuple[float, float]] = []  # (bytes, seconds) per all-to-all
        for shape in SHAPES:
            batch = shape_batch(*shape, cfg.vocab_size)
            scratch = ScratchRunner(runner, caches[shape])
            execute_operations(scratch.context(batch), runner.ops)  # warm
            timeline.take()
            start = time.perf_counter()
            execute_operations(scratch.context(batch), runner.ops)
            wall = time.perf_counter() - start
            spans = timeline.take()
            waits = sum(s.end - s.start for s in spans if tracks.is_wait(s.track))
            flops = cost.cost(batch, whole(batch))
            compute.append(([flops, shape[0], 1.0], wall - waits))
            sent = batch.num_tokens * bytes_per_token
            comm += [(sent, s.end - s.start) for s in spans if s.track == tracks.COMM]
        costs = fit_costs([x for x, _ in compute], [y for _, y in compute], required=(0,))
        link = fit_link(comm)
        fitted = torch.tensor([*costs, link.latency_s, link.s_per_byte], dtype=torch.float64)
        if group.size > 1:
            fitted = group.all_reduce(fitted) / group.size
        kappa, per_seq, per_pass, latency, s_per_byte = fitted.tolist()
        cal = Calibration(
            kappa=max(kappa, 1e-15),  # FLOPs always cost something: predictions stay ordered
            per_seq=per_seq,
            per_pass=per_pass,
            latency=latency,
            bytes_per_s=LinkFit(latency, s_per_byte).bytes_per_s,
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


def _measure_factors(
    cal: Calibration,
    runner: Runner,
    group: Group,
    cache: KVCache,
    cost: ModelFlops,
    run_mode: RunMode,
) -> None:
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
