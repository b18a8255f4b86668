"""``plan --reproduce``: the planner against published GPU measurements.

Each case is a published comparison of two overlap modes on a GPU cluster; the planner predicts
the same comparison from the cluster's table (``gpus.py``) and the model's config, and the table
shows how far apart they are. Nothing here feeds back into the parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from moe_overlap.core.a2a_mode import DispatchDtype
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE, TBO
from moe_overlap.core.repo_files import REPO_ROOT
from moe_overlap.planner.cluster import Cluster, load_cluster
from moe_overlap.planner.imbalance import eplb_imbalance, placement_shape
from moe_overlap.planner.inputs import (
    ModelSpec,
    PlanLayout,
    load_model_spec,
    make_layout,
    with_precision,
)
from moe_overlap.planner.plan import Planner

REF_004 = "ref 004"
LMSYS = "EP blog"
ATOM = "ATOM"
SOURCES = {
    REF_004: "Baidu's two-chunk overlap (SGLang PR 8144), DeepSeek-V3-0324 on 2x8 H800, TP16 "
    "DP16 DP attention EP16, DeepEP normal kernels",
    LMSYS: "SGLang's large-scale EP blog (lmsys.org, 2025-05-05), DeepSeek-V3 decode on H100 "
    "nodes, DeepEP low-latency kernels, EP72 (planned here as EP64: EP72 needs redundant "
    "experts)",
    ATOM: "ROCm ATOM's DeepSeek prefill with EPLB (+16.7% from placement, +24-34% with "
    "redundant experts; published as a range, here its middle), on AMD MI355X, planned on "
    "1x8-h200 as a stand-in (no MI355X in the GPU table)",
}


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    cluster: str
    workload: str
    mode: str  # the mode whose gain is published
    baseline: str  # over this one
    published: float  # (t_baseline / t_mode - 1) as measured, e.g. 0.1256
    band: tuple[float, float]  # the prediction must land inside (the issue's +-5 points)
    layout: tuple[int, int, int] = (16, 16, 16)  # tp, dp, ep (DP attention)
    config: str = "configs/deepseek-v3.json"
    # the published run was FP8: block-FP8 weights (DeepGEMM) and FP8 dispatch (DeepEP, as
    # SGLang sends DeepSeek-V3's activations), the combine in BF16
    fp8: bool = True
    # EPLB's gain (``mode`` on the trivial placement over ``mode`` placed by EPLB with
    # ``redundant`` extra slots) for routing of this balancedness; None: an overlap case
    balancedness: float | None = None
    redundant: int = 0

    @property
    def gain_of(self) -> str:
        if self.balancedness is None:
            return f"{self.mode} over {self.baseline}"
        return f"EPLB (R={self.redundant}) over trivial, B={self.balancedness:g}, {self.mode}"


CASES = (
    Case("two-chunk, one 3072-token request per rank", REF_004, "2x8-h800",
         "single-long:3072", "tbo+two-chunk", TBO.name, 0.1256, (0.075, 0.175)),
    # ref 004 gives no batch size: a throughput run fills each DP rank's prefill batch up to
    # SGLang's default --max-prefill-tokens, 16384 (docs/planner.md: this was chosen after the
    # 3072-token batch missed, and how the case moves with the batch)
    Case("two-chunk, random 30-3072-token requests", REF_004, "2x8-h800",
         "uniform:30-3072:16384", "tbo+two-chunk", TBO.name, 0.0515, (0.0, 0.10)),
    Case("decode TBO, 256 tokens per GPU", LMSYS, "8x8-h100", "decode:256:2000",
         TBO.name, NONE.name, 0.255, (0.205, 0.305), (64, 64, 64)),
    Case("decode TBO, 32 tokens per GPU", LMSYS, "8x8-h100", "decode:32:2000",
         TBO.name, NONE.name, -0.27, (-0.32, -0.22), (64, 64, 64)),
    # EPLB's gains: the balancedness without EPLB is not published; what each case assumes,
    # and why, is in docs/planner.md (EPLB's balancedness comes from our placement code)
    Case("EPLB, prefill", LMSYS, "4x8-h100", "uniform:2000-2000:16384", TBO.name, TBO.name,
         0.49, (0.44, 0.54), (32, 32, 32), balancedness=0.5, redundant=32),
    Case("EPLB, decode", LMSYS, "8x8-h100", "decode:256:2000", TBO.name, TBO.name,
         1.54, (1.49, 1.59), (64, 64, 64), balancedness=0.22, redundant=64),
    Case("EPLB placement alone, prefill", ATOM, "1x8-h200", "uniform:2000-2000:16384",
         NONE.name, NONE.name, 0.167, (0.117, 0.217), (8, 8, 8), balancedness=0.7),
    Case("EPLB with redundant experts, prefill", ATOM, "1x8-h200", "uniform:2000-2000:16384",
         NONE.name, NONE.name, 0.29, (0.19, 0.39), (8, 8, 8), balancedness=0.7, redundant=32),
)  # fmt: skip


@dataclass
class Outcome:
    case: Case
    predicted: float
    seconds: dict[str, float]

    @property
    def error(self) -> float:
        return self.predicted - self.case.published

    @property
    def in_band(self) -> bool:
        lo, hi = self.case.band
        return lo <= self.predicted <= hi

    @property
    def agrees(self) -> bool:
        """The mode the plan finds faster is the one measured faster."""
        return (self.predicted > 0) == (self.case.published > 0)


BatchesFor = Callable[[str, PlanLayout], list[ForwardBatch]]  # (workload, layout) -> per rank
ModeConfig = Callable[[str], OverlapConfig]


@functools.cache  # a plan is a pure function of its case (the tests ask twice)
def run_case(case: Case, batches_for: BatchesFor, mode_config: ModeConfig) -> Outcome:
    config = Path(case.config)
    if not config.exists():  # run outside the repository: the configs beside the package
        config = REPO_ROOT / case.config
    spec = load_model_spec(str(config))
    if case.fp8:
        spec = with_precision(spec, "fp8", DispatchDtype.FP8)
    tp, dp, ep = case.layout
    layout = make_layout(tp, dp, ep, True, spec.cfg, case.redundant)
    cluster = load_cluster(case.cluster)
    batches = batches_for(case.workload, layout)
    if case.balancedness is not None:
        return _eplb_case(case, spec, cluster, layout, batches, mode_config(case.mode))
    planner = Planner(spec, cluster, layout)
    seconds = {
        m: planner.plan(m, mode_config(m), batches).seconds for m in (case.baseline, case.mode)
    }
    return Outcome(case, seconds[case.baseline] / seconds[case.mode] - 1, seconds)


def _eplb_case(
    case: Case,
    spec: ModelSpec,
    cluster: Cluster,
    layout: PlanLayout,
    batches: list[ForwardBatch],
    config: OverlapConfig,
) -> Outcome:
    """The mode on the trivial placement over the mode on EPLB's, for routing of the case's
    balancedness (``planner/imbalance.py``: EPLB's balancedness from our placement code)."""
    assert case.balancedness is not None
    shape = placement_shape(spec.cfg, layout.ep, case.redundant, cluster.gpus_per_node)
    imbalance = eplb_imbalance(shape, case.balancedness)
    seconds = {}
    for name, b in (("trivial", imbalance.before), ("EPLB", imbalance.planned)):
        planner = Planner(spec, dataclasses.replace(cluster, expert_imbalance=1 / b), layout)
        seconds[name] = planner.plan(case.mode, config, batches).seconds
    return Outcome(case, seconds["trivial"] / seconds["EPLB"] - 1, seconds)


def reproduce(batches_for: BatchesFor, mode_config: ModeConfig) -> tuple[list[Outcome], float]:
    started = time.perf_counter()
    outcomes = [run_case(c, batches_for, mode_config) for c in CASES]
    return outcomes, time.perf_counter() - started


def reproduce_table(outcomes: list[Outcome]) -> Table:
    table = Table(title="the planner against published GPU measurements", title_justify="left")
    for name in ("case", "cluster, workload", "FP8", "gain of", "published", "predicted", "error"):
        table.add_column(name, justify="left" if name in ("case", "gain of") else "right")
    table.add_column("same winner", justify="center")
    table.add_column("source")
    for o in outcomes:
        c = o.case
        table.add_row(
            c.name,
            f"{c.cluster} EP{c.layout[2]}, {c.workload}",
            "weights, dispatch" if c.fp8 else "no",
            c.gain_of,
            f"{c.published:+.1%}",
            f"{o.predicted:+.1%}",
            f"{o.error * 100:+.1f} pt",
            "yes" if o.agrees else "NO",
            c.source,
        )
    table.caption = "\n".join(
        [
            "gain: t(baseline) / t(mode) - 1; error in percentage points. Parameters come from "
            "datasheets and kernel benchmarks (docs/planner.md), none fitted to these cases; "
            "the EPLB cases' balancedness without EPLB (B) is assumed (docs/planner.md). "
            "FP8: the published run's block-FP8 weights (GEMMs at the FP8 rate, 1-byte weights) "
            "and FP8 dispatch (1 byte and a scale per 128 per element; combine in BF16), as "
            "planned with --quantization fp8 --moe-dispatch-dtype fp8.",
            *(f"{key}: {text}" for key, text in SOURCES.items()),
        ]
    )
    table.caption_justify = "left"
    return table
