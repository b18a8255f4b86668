"""Every overlap mode and its facts, in one registry.

A mode's entry says what a reader of any other module needs: its name, how it runs (which of
the engine's executions it is), the class that runs it, the flag that selects it, whether a
CUDA graph may hold its decode steps, which layouts it refuses and why, whether it combines
with PD multiplexing, and the variants ``auto`` may choose among. The flags, ``bench
--modes``, the planner, ``auto`` and the layout refusals all read it, so a mode is added here
and nowhere else (a new *kind* of execution also needs its code: a ``Runs`` member, its scheme
class and its simulation).

The mode names are written as strings only in this module; other modules use the entries
(``NONE.name``) or ask the registry (``MODES[cfg.mode].runs``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.parallel_config import ParallelConfig


class Runs(enum.Enum):
    """How a mode runs a forward: the engine's kinds of execution."""

    PLAIN = "plain"  # every op once, in order, waiting for each transfer
    BLOCKS = "blocks"  # one batch; the experts in blocks whose combines overlap the next block
    SPLIT = "split"  # micro-batches run stage by stage, the later ones lagging (one thread)
    THREADS = "threads"  # two micro-batch threads handing a baton at each transfer
    CHOICE = "choice"  # one of the modes above, chosen per forward


class Graphs(enum.Enum):
    """Whether a CUDA graph may hold the mode's decode steps."""

    NEVER = "never"
    ALWAYS = "always"
    LOW_LATENCY = "low_latency"  # only over the low-latency dispatch (blocks sized by counts)


@dataclass(frozen=True)
class Refusal:
    """A layout the mode cannot run on: ``refuses(par)``, and ``why`` (``{par.pp}`` etc. are
    filled from the layout)."""

    refuses: Callable[[ParallelConfig], bool]
    why: str


@dataclass(frozen=True)
class AutoChoice:
    """A variant ``auto`` may choose: its name in ``--auto-modes`` and the knobs it sets on
    the engine's ``OverlapConfig`` (the others are the engine's)."""

    label: str
    knobs: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class OverlapMode:
    name: str
    summary: str  # one line for --help and the docs
    runs: Runs
    scheme: str | None  # "module:Class" of its OverlapScheme; None: the runner's plain op list
    flag: str  # the generate/serve flag that selects it ("" for the default)
    enable_field: str | None = None  # the EngineArgs switch in SGLang's or vLLM's spelling
    micro_batches: int = 1  # per forward; a SPLIT mode's count is the --num-micro-batches knob
    knobs: tuple[str, ...] = ()  # the OverlapConfig fields it reads (printed back when set)
    graphs: Graphs = Graphs.NEVER
    refusals: tuple[Refusal, ...] = ()
    with_pdmux: bool = True
    auto_choices: tuple[AutoChoice, ...] = ()

    def graphable(self, low_latency: bool) -> bool:
        """Whether a CUDA graph may hold its decode step over this step's dispatch."""
        return self.graphs is Graphs.ALWAYS or (low_latency and self.graphs is Graphs.LOW_LATENCY)

    def refuse(self, par: ParallelConfig) -> None:
        """Raise the first of its refusals that applies to the layout ``par``."""
        for refusal in self.refusals:
            if refusal.refuses(par):
                raise ConfigError(refusal.why.format(par=par))


class ModeRegistry(Mapping[str, OverlapMode]):
    """The modes by name, in the order they were registered (``auto``'s ties go to the
    earlier, simpler one). A live view: argparse's choices and the checks read it when used."""

    def __init__(self) -> None:
        self._modes: dict[str, OverlapMode] = {}

    def register(self, mode: OverlapMode) -> OverlapMode:
        if mode.name in self._modes:
            raise ValueError(f"overlap mode {mode.name!r} is registered already")
        self._modes[mode.name] = mode
        return mode

    def unregister(self, name: str) -> None:
        del self._modes[name]

    def __getitem__(self, name: str) -> OverlapMode:
        if name not in self._modes:
            raise ConfigError(f"overlap mode {name!r}: use one of {', '.join(self._modes)}")
        return self._modes[name]

    def __contains__(self, name: object) -> bool:
        return name in self._modes

    def __iter__(self) -> Iterator[str]:
        return iter(self._modes)

    def __len__(self) -> int:
        return len(self._modes)

    def auto_choices(self) -> dict[str, tuple[OverlapMode, AutoChoice]]:
        """Every variant ``auto`` may choose, by label, in registration order."""
        return {c.label: (m, c) for m in self._modes.values() for c in m.auto_choices}


MODES = ModeRegistry()
_TBO_KNOBS = (
    "tbo_token_distribution_threshold",
    "num_micro_batches",
    "tbo_split_policy",
    "tbo_min_tokens",
    "tbo_mode_mismatch",
    "tbo_decode_order",
)

NONE = MODES.register(
    OverlapMode(
        "none",
        "no overlap: each transfer is waited for where it starts",
        Runs.PLAIN,
        scheme=None,
        flag="",
        graphs=Graphs.ALWAYS,
        auto_choices=(AutoChoice("none"),),
    )
)
SBO = MODES.register(
    OverlapMode(
        "sbo",
        "SGLang's single-batch overlap: finished experts' outputs travel while the rest compute",
        Runs.BLOCKS,
        scheme="moe_overlap.overlap.sbo:SingleBatchOverlap",
        flag="--enable-single-batch-overlap",
        enable_field="enable_single_batch_overlap",
        knobs=("sbo_combine_blocks", "sbo_comm_sms"),
        graphs=Graphs.LOW_LATENCY,
        auto_choices=(AutoChoice("sbo"),),
    )
)
TBO = MODES.register(
    OverlapMode(
        "tbo",
        "SGLang's two-batch overlap: micro-batches whose compute and all-to-alls interleave",
        Runs.SPLIT,
        scheme="moe_overlap.overlap.tbo:TwoBatchOverlap",
        flag="--enable-two-batch-overlap",
        enable_field="enable_two_batch_overlap",
        micro_batches=2,
        knobs=_TBO_KNOBS,
        graphs=Graphs.ALWAYS,
        with_pdmux=False,
        auto_choices=(
            AutoChoice("tbo2", (("tbo_split_policy", "time"),)),
            AutoChoice("tbo3", (("num_micro_batches", 3), ("tbo_split_policy", "time"))),
        ),
    )
)
DBO = MODES.register(
    OverlapMode(
        "dbo",
        "vLLM's dual-batch overlap: two micro-batch threads handing a baton at each transfer",
        Runs.THREADS,
        scheme="moe_overlap.overlap.dbo:DualBatchOverlap",
        flag="--enable-dbo",
        enable_field="enable_dbo",
        micro_batches=2,
        knobs=("dbo_decode_token_threshold", "dbo_prefill_token_threshold"),
        graphs=Graphs.ALWAYS,
        refusals=(
            Refusal(
                lambda par: par.replica_size == 1,
                "--enable-dbo needs more than one rank to overlap with; set --ep 2 or --tp 2 "
                "or more",
            ),
        ),
        with_pdmux=False,
        auto_choices=(AutoChoice("dbo"),),
    )
)
AUTO = MODES.register(
    OverlapMode(
        "auto",
        "ours: every forward, the mode predicted fastest from a cost model calibrated at "
        "start-up and corrected from measured forwards",
        Runs.CHOICE,
        scheme="moe_overlap.overlap.auto:AutoOverlap",
        flag="--overlap auto",
        knobs=("auto_modes", "log_overlap_decisions"),
        refusals=(
            Refusal(
                lambda par: par.pp > 1,
                "--overlap auto with --pp {par.pp}: auto calibrates on whole forwards, which "
                "a pipeline stage does not run; choose tbo, sbo or dbo (they run inside each "
                "stage)",
            ),
        ),
        with_pdmux=False,
    )
)
