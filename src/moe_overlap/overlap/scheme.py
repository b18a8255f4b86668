"""The contract of an overlap scheme (TBO, SBO, DBO and auto; "none" is the runner's plain op
list), and what a scheme reads of the rank's model runner (``runtime/model_runner.py``, a
layer above, satisfies ``Runner`` without naming it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs
from moe_overlap.core.timeline import Timeline
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.overlap.operations import Op, Yield


class Runner(Protocol):
    model: MoeForCausalLM
    ops: list[Op | Yield]  # the model's whole op list, run in order without overlap
    kv_cache: KVCache
    dispatcher: Dispatcher  # the rank's all-to-all; calibration runs scratch forwards over it
    timeline: Timeline

    def context(self, batch: ForwardBatch, name: str = tracks.FIRST) -> ForwardContext: ...


class OverlapScheme(Protocol):
    def forward(
        self, batch: ForwardBatch, runner: Runner, inputs: StageInputs | None = None
    ) -> ForwardOutputs | None:
        """The stage's outputs for ``batch`` (the logits on the last stage, else the hidden
        states the next starts from), or None when the ranks agreed not to use the
        scheme this forward (the runner then runs its plain op list)."""
        ...

    def largest_dispatch(self, batches: Sequence[ForwardBatch]) -> int:
        """The most tokens one dispatch of this step carries on any rank, from every rank's
        batch (``batches``) and no collective: a micro-batch's where the ranks will agree to
        split, the whole batch's otherwise. The low-latency dispatch's capacity bounds this,
        as DeepEP's bounds each dispatch call."""
        ...
