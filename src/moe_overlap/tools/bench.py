"""``moe-overlap bench``: one workload through every overlap mode, on the same ranks and link.

Modes alternate within each repetition (in a rotating order) so machine noise hits all alike.
``T_comm`` is measured in the same run: in the no-overlap mode every all-to-all is waited for as
soon as it starts, so the sum of its communication spans (the slowest rank's) is the time spent
communicating, and ``T_comp = T_none - T_comm``. The physical limit of a forward is
``max(T_comp, T_comm)``. Each mode's "comm hidden" is read off its own recorded forward: the
share of the time communication was in flight while some micro-batch computed (0-100%,
core/overlap_stats.py; on CUDA, where compute spans are host launch times, from the forward
times instead); its share of the limit is ``limit / T_mode``. On CUDA a forward is timed from
a synchronized device to a synchronized device, and an all-to-all's span lasts what CUDA events
measured on the communication stream. ``saving_vs_limit`` in the JSON is the older figure
``(T_none - T_mode) / (T_none - limit)``: it assumes every mode computes as long as ``none`` and
so can pass 100% where splitting makes compute faster.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import Progress

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.overlap_stats import OverlapStats, combined, overlap_stats
from moe_overlap.core.step import SampleSpec, StepReply, StepRequest
from moe_overlap.core.workloads import Workload, make_batches
from moe_overlap.tools.bench_notes import mode_notes


@dataclass
class ModeResult:
    mode: str
    times: list[float] = field(default_factory=list)  # seconds per forward

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass
class BenchReport:
    workload: Workload
    results: dict[str, ModeResult]
    t_comm: float  # the MoE's communication (all-to-all, or the gather backend's collectives)
    recording: dict  # mode -> rank -> spans of one recorded forward
    t_tp_comm: float = 0.0  # attention-TP all-reduces and all-gathers: blocking in every mode
    on_gpu: bool = False  # CUDA: stage spans are host launch times (the "comm" ones are not)
    # mode -> what its figure did not measure: an empty micro-batch, no overlap (bench_notes.py)
    notes: dict[str, list[str]] = field(default_factory=dict)
    comm_bytes: int = 0  # the MoE's bytes on the busiest rank's link per forward (CPU)

    @property
    def t_none(self) -> float:
        return self.results[NONE.name].median

    @property
    def t_comp(self) -> float:
        return max(self.t_none - self.t_comm - self.t_tp_comm, 0.0)

    @property
    def limit(self) -> float:
        """Hide all the MoE's communication; the TP collectives stay on the critical path."""
        return max(self.t_comp, self.t_comm) + self.t_tp_comm

    def speedup(self, mode: str) -> float:
        return self.t_none / self.results[mode].median

    def saving_vs_limit(self, mode: str) -> float | None:
        """``(T_none - T_mode) / (T_none - limit)``: assumes the mode computes as long as none."""
        room = self.t_none - self.limit
        if room <= 0:
            return None
        return (self.t_none - self.results[mode].median) / room

    def limit_share(self, mode: str) -> float:
        """How near the mode came to the physical limit: ``limit / T_mode``."""
        return self.limit / self.results[mode].median

    def hidden(self, mode: str) -> float | None:
        """The share of the MoE's communication the mode hid: off its recorded timeline; on
        CUDA, where compute spans are host launch times, ``(T_none - T_mode) / T_comm``."""
        if not self.on_gpu:
            return self.overlap(mode).hidden_share
        if self.t_comm <= 0:
            return None
        return min(max((self.t_none - self.results[mode].median) / self.t_comm, 0.0), 1.0)

    def overlap(self, mode: str) -> OverlapStats:
        """Compute, communication and their overlap in the mode's recorded forward (all ranks)."""
        return combined([overlap_stats(spans or []) for spans in self.recording[mode]])

    def to_json(self, bounds: dict[str, float | None] | None = None) -> dict:
        """Every figure; ``bounds``: per mode the zero-host-cost bound of its stage order
        (``planner/stage_bound.py``), None where the planner cannot model the layout."""
        modes = {}
        for name, r in self.results.items():
            bound = (bounds or {}).get(name)
            modes[name] = {
                "times_s": r.times,
                "median_s": r.median,
                "tokens_per_s": self.workload.tokens / r.median,
                "speedup": self.speedup(name),
                "comm_hidden": self.hidden(name),
                "limit_share": self.limit_share(name),
                "saving_vs_limit": self.saving_vs_limit(name),
                "zero_host_bound_s": bound,
                "zero_host_bound_share": None if bound is None else bound / r.median,
                "notes": self.notes.get(name, []),
            }
        return {
            "workload": self.workload.spec,
            "tokens_per_forward": self.workload.tokens,
            "t_none_s": self.t_none,
            "t_comp_s": self.t_comp,
            "t_comm_s": self.t_comm,
            "t_tp_comm_s": self.t_tp_comm,
            "comm_bytes": self.comm_bytes,
            "limit_s": self.limit,
            "modes": modes,
        }


def fill_context(executor, workload: Workload, vocab: int, seed: int, chunk: int = 4096) -> None:
    """Decode workloads: prefill every sequence's context once (the timed step rewrites the
    token after it, so the cache stays valid across repetitions)."""
    if not workload.decode:
        return
    gen = torch.Generator().manual_seed(seed + 1)
    per_forward = max(1, chunk // workload.context)
    size = max(len(lengths) for lengths in workload.lengths)
    for first in range(0, size, per_forward):
        batches = []
        for lengths in workload.lengths:
            slots = list(range(first, min(first + per_forward, len(lengths))))
            ids = torch.randint(vocab, (workload.context * len(slots),), generator=gen)
            batches.append(
                ForwardBatch(ids, slots, [0] * len(slots), [workload.context] * len(slots))
                if slots
                else ForwardBatch.idle()
            )
        executor.run(batches, mode_config(NONE.name))


def run_bench(
    executor,
    workload: Workload,
    modes: list[str],
    repeat: int,
    vocab: int,
    seed: int = 0,
    progress: bool = True,
    overrides: dict | None = None,
    on_gpu: bool = False,
) -> BenchReport:
    arm = Arm(executor, {m: (overrides or {}).get(m) or mode_config(m) for m in modes})
    return run_arms({"": arm}, workload, repeat, vocab, seed, progress, on_gpu)[""]


@dataclass
class Arm:
    """One engine's side of a bench: its executor, each mode's config, what it measured."""

    executor: Any
    configs: dict[str, Any]  # mode -> OverlapConfig
    results: dict[str, ModeResult] = field(default_factory=dict)
    recording: dict = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    comm: list[float] = field(default_factory=list)
    tp_comm: list[float] = field(default_factory=list)
    comm_bytes: int = 0

    def warm(self, batches: list[ForwardBatch]) -> None:
        """A warm-up, then one recorded forward per mode for the timeline."""
        for m, cfg in self.configs.items():
            step(self.executor, batches, cfg)
            reply = step(self.executor, batches, cfg, record=True)
            self.recording[m], self.notes[m] = reply.spans, mode_notes(cfg, reply)
            self.results[m] = ModeResult(m)

    def repetition(self, batches: list[ForwardBatch], rep: int, advance) -> None:
        """Every mode once (in a rotating order), then the same-run measurement of T_comm."""
        modes = list(self.configs)
        for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            _sync()
            start = time.perf_counter()
            step(self.executor, batches, self.configs[m])
            _sync()  # on CUDA the forward's kernels, not their launches
            self.results[m].times.append(time.perf_counter() - start)
            advance()
        if NONE.name in modes:
            spans = step(self.executor, batches, self.configs[NONE.name], record=True).spans
            self.comm.append(_slowest_track(spans, tracks.COMM))
            self.tp_comm.append(_slowest_track(spans, tracks.TP_COMM))
            self.comm_bytes = _busiest_bytes(spans)

    def report(self, workload: Workload, on_gpu: bool) -> BenchReport:
        t_comm = statistics.median(self.comm) if self.comm else 0.0
        t_tp = statistics.median(self.tp_comm) if self.tp_comm else 0.0
        return BenchReport(
            workload,
            self.results,
            t_comm,
            self.recording,
            t_tp,
            on_gpu,
            self.notes,
            self.comm_bytes,
        )


def run_arms(
    arms: dict[str, Arm],
    workload: Workload,
    repeat: int,
    vocab: int,
    seed: int = 0,
    progress: bool = True,
    on_gpu: bool = False,
) -> dict[str, BenchReport]:
    """Each arm's report; the arms take turns, one repetition each, so drift in the machine's
    load hits them alike (``bench --compare-dispatch-dtype``: one engine per dispatch dtype)."""
    batches = make_batches(workload, vocab, seed)
    total = sum(len(a.configs) for a in arms.values()) * (repeat + 2)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task(f"bench {workload.spec}", total=total)
        for arm in arms.values():
            fill_context(arm.executor, workload, vocab, seed)
            arm.warm(batches)
            bar.advance(task, 2 * len(arm.configs))
        for rep in range(repeat):
            for arm in arms.values():
                arm.repetition(batches, rep, lambda: bar.advance(task))
    return {name: arm.report(workload, on_gpu) for name, arm in arms.items()}


def _sync() -> None:
    if torch.cuda.is_initialized():  # this process runs the forward on a GPU (one process)
        torch.cuda.synchronize()


def step(executor, batches: list[ForwardBatch], overlap, record: bool = False) -> StepReply:
    """One timed step as a server runs it: the ranks sample each sequence's next token
    (greedy) and send back ids, not logits."""
    samples = [[SampleSpec()] * b.num_seqs for b in batches]
    return executor.step(StepRequest(batches, samples, overlap, record))


def _busiest_bytes(per_rank: list) -> int:
    """The most bytes any rank's MoE transfers put on its link (``Span.nbytes``)."""
    return max(
        sum(s.nbytes or 0 for s in spans or [] if s.track == tracks.COMM) for spans in per_rank
    )


def _slowest_track(per_rank: list, track: str) -> float:
    """The longest total time any rank spent on ``track``."""
    return max(sum(s.end - s.start for s in spans if s.track == track) for spans in per_rank)
