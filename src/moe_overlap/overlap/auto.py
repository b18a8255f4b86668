"""``--overlap auto`` (ours): choose, every forward, the overlap mode predicted to be fastest.

The candidates are none, SBO, TBO with two or three micro-batches (time-balanced cuts) and DBO.
One all-reduce per forward, the agreement every overlapped forward already pays, carries each
rank's work (FLOPs, tokens, sequences), its TBO vote and how long its previous forward took; from
the same table and the same calibration every rank predicts the same times (predict.py), picks
the same mode, derives TBO's and DBO's own agreement from it, and corrects the executed mode's
factor from the measured time. On a few set forwards a mode predicted nearly as fast runs
instead, so that its factor is measured again (``predict.explore``: the forward's number and
the shared predictions decide it, so it needs no collective). The first forward calibrates
(calibrate.py).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch, most_tokens
from moe_overlap.core.mode_labels import auto_choice_config
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, Runs
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs
from moe_overlap.distributed.groups import Group
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.overlap.agreement import dbo_decide, tbo_decide, tbo_local_vote
from moe_overlap.overlap.calibrate import calibrate
from moe_overlap.overlap.operations import execute_operations
from moe_overlap.overlap.predict import (
    CORRECT_WEIGHT,
    EXPLORE_WEIGHT,
    Calibration,
    Choice,
    StepStats,
    candidates,
    choose,
    corrected,
    explore,
    raw_times,
    shape,
)
from moe_overlap.overlap.scheme import Runner
from moe_overlap.overlap.schemes import scheme_class
from moe_overlap.overlap.split import whole

FLOPS, TOKENS, SEQS, LAST_S, VOTES = 0, 1, 2, 3, 4  # rows; VOTES.. holds tbo_local_vote's four


@dataclasses.dataclass(frozen=True)
class Step:
    stats: StepStats
    tbo_decode: bool  # every busy rank decodes: TBO's decode strategy
    slowest_last_s: float  # the previous forward's time on the slowest rank


class AutoOverlap:
    def __init__(self, model: MoeForCausalLM, cfg: OverlapConfig, group: Group):
        self.model, self.cfg, self.group = model, cfg, group
        self.cost = ModelFlops.for_model(model.cfg)
        # every choice's scheme, over this engine's knobs (Any: TBO's and DBO's ``run`` take
        # what auto's agreement decided, which differs by kind)
        self.schemes: dict[str, Any] = {}
        for label in candidates():
            choice = auto_choice_config(cfg, label)
            if MODES[choice.mode].scheme is not None:
                self.schemes[label] = scheme_class(choice.mode)(model, choice, group)
        self.calibration: Calibration | None = None
        self.last: tuple[str, float, float] | None = None  # executed mode, raw prediction, weight
        self.last_s = 0.0  # how long this rank's previous auto forward took
        self.last_choice: Choice | None = None
        self.steps = 0

    def forward(
        self, batch: ForwardBatch, runner: Runner, inputs: StageInputs | None = None
    ) -> ForwardOutputs | None:
        """The chosen mode's outputs; None on one rank, where nothing is hidden. Not under
        pipeline parallelism (``inputs``): the engine refuses auto with ``--pp``."""
        if self.group.size == 1:
            return None
        if self.calibration is None:
            self.calibration = self._calibrate(runner)
        start = time.perf_counter()
        step = self.agree(batch)
        runner.timeline.add(tracks.wait(tracks.FIRST), "auto agreement", start, time.perf_counter())
        cal = self.calibration
        if self.last is not None:
            mode, raw, weight = self.last
            corrected(cal, mode, raw, step.slowest_last_s, weight=weight)
        choice = choose(cal, step.stats, self.group.size, self.cfg.auto_modes)
        choice = explore(choice, self.steps + 1)  # steps: auto forwards so far, alike everywhere
        self.last_choice = choice
        weight = EXPLORE_WEIGHT if choice.explored else CORRECT_WEIGHT
        self.last = (choice.mode, raw_times(cal, step.stats)[choice.mode], weight)
        split = step.stats.dbo_split
        out = self._run(choice.mode, batch, runner, step.tbo_decode, split)
        self.last_s = time.perf_counter() - start
        self._report(runner, choice, start)
        return out

    def largest_dispatch(self, batches: Sequence[ForwardBatch]) -> int:
        """The whole batch's: the mode is chosen inside the step, and none may win."""
        return most_tokens(batches)

    def agree(self, batch: ForwardBatch) -> Step:
        """One all-reduce: every rank's column of work, votes and last forward time."""
        column = [self.cost.cost(batch, whole(batch)), batch.num_tokens, batch.num_seqs]
        column += [self.last_s, *tbo_local_vote(batch, self.cfg.tbo_min_tokens)]
        table = self.group.gather_columns(torch.tensor(column, dtype=torch.float64))
        tokens = [int(t) for t in table[TOKENS].tolist()]
        tbo = tbo_decide(
            table[VOTES:].min(dim=1).values.long().tolist(), self.cfg.tbo_mode_mismatch
        )
        ones = torch.ones(len(tokens), dtype=torch.int64)
        counts = torch.tensor(tokens, dtype=torch.int64)
        dbo = dbo_decide(torch.stack([counts, counts, ones, 0 * ones]))  # vLLM's cut, no vote
        stats = StepStats(
            flops=table[FLOPS].tolist(),
            tokens=tokens,
            seqs=[int(s) for s in table[SEQS].tolist()],
            tbo_ok=tbo.run,
            dbo_split=dbo.split_point if dbo.run else None,
        )
        return Step(stats, tbo.decode, float(table[LAST_S].max()))

    def _run(self, mode: str, batch: ForwardBatch, runner: Runner, decode: bool, split: int | None):
        runs = shape(mode)[0]
        if runs is Runs.PLAIN:
            return ForwardOutputs.of(execute_operations(runner.context(batch), runner.ops))
        scheme = self.schemes[mode]
        if runs is Runs.BLOCKS:
            return scheme.forward(batch, runner)
        if runs is Runs.SPLIT:
            return scheme.run(batch, runner, decode)
        if split is None:  # choose() offers a threaded mode only where the ranks agreed a cut
            raise RuntimeError(f"auto chose {mode} without an agreed split point")
        return scheme.run(batch, runner, split)

    def _calibrate(self, runner: Runner) -> Calibration:
        def run_mode(mode: str, batch: ForwardBatch, scratch: Runner) -> None:
            self._run(mode, batch, scratch, False, batch.num_tokens // 2)

        return calibrate(runner, self.group, self.cfg.sbo_combine_blocks, run_mode)

    def _report(self, runner: Runner, choice: Choice, start: float) -> None:
        self.steps += 1
        runner.timeline.add(
            tracks.DECISION, f"auto: {choice.describe()}", start, time.perf_counter()
        )
        if self.cfg.log_overlap_decisions and self.group.rank == 0:
            print(f"[auto] forward {self.steps}: {choice.describe()}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for scheme in self.schemes.values():
            if hasattr(scheme, "close"):
                scheme.close()
