"""``bench --eplb-compare R``: one workload, usually under ``--expert-skew``, first on the
trivial placement (E/ep experts per rank), then on EPLB's placement of the routing recorded in
that first run, without and with R redundant experts. Per placement: the balancedness the
recorder measured (mean EP rank load over the largest, averaged over the MoE layers) and each
mode's milliseconds per forward, all in one run."""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import TRIVIAL
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.workloads import Workload, make_batches
from moe_overlap.engine.llm import LLM
from moe_overlap.tools.bench import BenchReport, run_bench, step
from moe_overlap.tools.cli_args import bench_engine_kwargs
from moe_overlap.tools.trace import write_outputs


@dataclass(frozen=True)
class Placed:
    """One placement's run: its name, per MoE layer the measured balancedness and routed
    load per logical expert, and the bench's times per mode."""

    name: str
    balancedness: list[float]
    load: list[list[int]]
    report: BenchReport

    @property
    def mean_balancedness(self) -> float:
        return sum(self.balancedness) / len(self.balancedness)


def eplb_compare(
    kwargs: dict[str, Any],
    workload: Workload,
    modes: list[str],
    configs: dict[str, OverlapConfig],
    repeat: int,
    redundant: int,
) -> list[Placed]:
    """The trivial placement, EPLB's from its recorded load, and EPLB's with ``redundant``
    extra slots; ``kwargs``: the engine's settings (``LLM``'s keywords)."""
    if redundant < 0:
        raise ConfigError(f"--eplb-compare={redundant}: want the redundant experts, >= 0")
    if kwargs.get("ep_num_redundant_experts") or kwargs.get("init_expert_location") != TRIVIAL:
        raise ConfigError(
            "--eplb-compare places the experts itself: drop --ep-num-redundant-experts and "
            "--init-expert-location"
        )
    runs = [("trivial", 0), ("eplb", 0), (f"eplb+{redundant} redundant", redundant)]
    placed: list[Placed] = []
    with tempfile.TemporaryDirectory(prefix="moe-overlap-eplb-") as tmp:
        load_file = Path(tmp) / "load.json"
        for name, extra in runs[: 3 if redundant else 2]:
            location = str(load_file) if placed else TRIVIAL
            settings = kwargs | {
                "ep_num_redundant_experts": extra,
                "init_expert_location": location,
            }
            placed.append(_run(name, settings, workload, modes, configs, repeat))
            if len(placed) == 1:
                load_file.write_text(json.dumps({"load": placed[0].load}))
    return placed


def _run(
    name: str,
    settings: dict[str, Any],
    workload: Workload,
    modes: list[str],
    configs: dict[str, OverlapConfig],
    repeat: int,
) -> Placed:
    with LLM(**settings) as llm:
        vocab, seed = llm.config.vocab_size, llm.seed
        report = run_bench(llm.executor, workload, modes, repeat, vocab, seed, overrides=configs)
        llm.start_expert_distribution_record()  # one more forward, its routing counted
        step(llm.executor, make_batches(workload, vocab, seed), configs[NONE.name])
        recorded = llm.expert_distribution()
    return Placed(name, recorded.balancedness, recorded.load, report)


def eplb_table(placed: list[Placed], title: str) -> Table:
    """Per placement: its balancedness, then per mode ms per forward and the speed-up over the
    trivial placement in that mode."""
    table = Table(title=title, title_justify="left")
    table.add_column("placement", no_wrap=True)
    table.add_column("balancedness", justify="right")
    modes = list(placed[0].report.results)
    for mode in modes:
        table.add_column(f"{mode} ms", justify="right")
        table.add_column("vs trivial", justify="right")
    base = placed[0].report.results
    for p in placed:
        cells = [p.name, f"{p.mean_balancedness:.3f}"]
        for mode in modes:
            ms = p.report.results[mode].median
            cells += [f"{ms * 1e3:.1f}", f"{base[mode].median / ms:.2f}x"]
        table.add_row(*cells)
    table.caption = (
        "balancedness: mean EP rank load / largest, as the recorder counted it in one forward "
        "of the workload, averaged over the MoE layers (1.0 is even); the EPLB placements come "
        "from the routing recorded on the trivial one; ms: median per forward"
    )
    table.caption_justify = "left"
    return table


def eplb_json(placed: list[Placed]) -> dict:
    return {
        p.name: {
            "balancedness": p.balancedness,
            "modes": {m: r.median for m, r in p.report.results.items()},
        }
        for p in placed
    }


def bench_eplb(
    args: argparse.Namespace,
    workload: Workload,
    modes: list[str],
    configs: dict[str, OverlapConfig],
    console: Console,
    title: str,
) -> int:
    """``--eplb-compare R``: the modes on the trivial placement, on EPLB's, and on EPLB's
    with R redundant experts, one table."""
    engine = bench_engine_kwargs(args, workload)
    placed = eplb_compare(engine, workload, modes, configs, args.repeat, args.eplb_compare)
    Console(width=max(console.width, 120)).print(eplb_table(placed, title))
    holds = f"the {placed[0].name} placement's run"
    write_outputs(console, placed[0].report.recording, args, eplb_json(placed), holds)
    return 0
