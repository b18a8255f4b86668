"""A plan as a user reads it: the table, the bench's JSON shape, the flags to use."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from moe_overlap.core.errors import ConfigError, is_finite_number
from moe_overlap.core.mode_labels import command_flags
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.planner.plan import ModePlan
from moe_overlap.planner.sweep import SweepPoint


def recommend(plans: dict[str, ModePlan], configs: dict[str, OverlapConfig]) -> tuple[str, str]:
    """(best mode, a sentence with its flags); overlap only if it beats none by 3%."""
    none = plans[NONE.name].seconds
    best = min(plans, key=lambda m: plans[m].seconds)
    if plans[best].seconds > none * 0.97:
        return NONE.name, f"no overlap: the best mode ({best}) gains under 3% here"
    gain = none / plans[best].seconds
    return best, f"{best} ({gain:.2f}x over none): {command_flags(configs[best])}"


def plan_table(plans: dict[str, ModePlan], tokens: int, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("mode", no_wrap=True)
    columns = ("tokens/s", "ms/forward", "speed-up", "T_comp", "T_comm", "limit", "0-host")
    for name in (*columns, "bound by"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("note")
    none = plans[NONE.name].seconds
    for mode, p in plans.items():
        table.add_row(
            mode,
            f"{tokens / p.seconds:,.0f}",
            f"{p.seconds * 1e3:.1f}",
            f"{none / p.seconds:.2f}x",
            f"{p.t_comp * 1e3:.1f}",
            f"{p.t_comm * 1e3:.1f}",
            f"{p.limit * 1e3:.1f}",
            f"{p.zero_host_s * 1e3:.1f}",
            p.bottleneck,
            p.note,
        )
    table.caption = (
        "predicted, not measured: per mode the busiest rank's compute (T_comp) and all-to-all "
        "time from launch to completion (T_comm), limit = max(T_comp, T_comm); 0-host: the "
        "mode's schedule with no host cost per launch and so no drains, the bound its stage "
        "order allows (the first dispatch and last combine stay exposed)"
    )
    table.caption_justify = "left"
    return table


def plan_json(plans: dict[str, ModePlan], tokens: int, workload: str) -> dict:
    """The bench's JSON shape (``modes.<mode>.median_s``, ``speedup``), marked predicted."""
    none = plans[NONE.name]
    modes = {
        m: {
            "times_s": [p.seconds],
            "median_s": p.seconds,
            "tokens_per_s": tokens / p.seconds,
            "speedup": none.seconds / p.seconds,
            "t_comp_s": p.t_comp,
            "t_comm_s": p.t_comm,
            "limit_s": p.limit,
            "zero_host_bound_s": p.zero_host_s,
            "zero_host_bound_share": p.zero_host_s / p.seconds,
            "bottleneck": p.bottleneck,
            "micro_batch_tokens": p.micro_batches,
            "note": p.note,
        }
        for m, p in plans.items()
    }
    return {
        "predicted": True,
        "workload": workload,
        "tokens_per_forward": tokens,
        "t_none_s": none.seconds,
        "t_comp_s": none.t_comp,
        "t_comm_s": none.t_comm,
        "limit_s": none.limit,
        "modes": modes,
    }


def sweep_table(points: list[SweepPoint], context: int, title: str) -> Table:
    """Per decode batch size: none's predicted ms and each overlapped mode's speed-up."""
    modes = [m for m in points[0].seconds if m != NONE.name]
    table = Table(title=title, title_justify="left")
    table.add_column("batch/rank", justify="right")
    table.add_column("none ms", justify="right")
    for m in modes:
        table.add_column(m, justify="right")
    for p in points:
        cells = [f"{p.speedup(m):.2f}x" for m in modes]
        table.add_row(str(p.batch_size), f"{p.seconds[NONE.name] * 1e3:.2f}", *cells)
    table.caption = (
        f"predicted decode step, {context} tokens of context per sequence; speed-up over none "
        "with every mode forced to split (vote thresholds at 1)"
    )
    table.caption_justify = "left"
    return table


def read_bench(path: str, workload: str, tokens: int | None = None, ep: int | None = None) -> dict:
    """A ``bench --json`` file of ``workload``, checked before anything is planned: each mode
    with a positive ``median_s`` and a ``speedup``; where the file says them, the same tokens
    per forward (the same data-parallel groups) and the same ``ep`` as the plan's."""
    where = f"--compare-bench {path}"
    try:
        measured = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: not JSON ({exc}); pass a `bench --json` file") from None
    modes = measured.get("modes") if isinstance(measured, dict) else None
    if not isinstance(modes, dict) or not modes:
        raise ConfigError(f'{where}: no "modes" object; pass a `bench --json` file')
    if measured.get("predicted"):
        raise ConfigError(f"{where}: that file is a plan (predicted), not a bench")
    if measured.get("workload") != workload:
        raise ConfigError(
            f"{where}: the bench ran workload {measured.get('workload')!r}, the plan "
            f"{workload!r}: plan the same workload"
        )
    _check_same_layout(measured, where, tokens, ep)
    for mode, row in modes.items():
        ok = isinstance(row, dict) and all(
            is_finite_number(row.get(k)) and row[k] > 0 for k in ("median_s", "speedup")
        )
        if not ok:
            raise ConfigError(f"{where}: mode {mode!r} needs a positive median_s and speedup")
    return measured


def _check_same_layout(measured: dict, where: str, tokens: int | None, ep: int | None) -> None:
    """The same workload string deals different batches to a different number of groups."""
    for key, planned, flag in (
        ("tokens_per_forward", tokens, "tokens per forward"),
        ("ep", ep, "EP"),
    ):
        benched = measured.get(key)
        if planned is not None and benched is not None and benched != planned:
            raise ConfigError(
                f"{where}: the bench's {flag}: {benched}, the plan's: {planned}; plan the bench's "
                "layout (--ep, --tp, --dp, --enable-dp-attention)"
            )


def compare_table(plans: dict[str, ModePlan], measured: dict, workload: str) -> Table:
    """The plan next to a ``bench --json`` of the same workload (``read_bench``): per mode both
    times and the plan's error relative to the measurement (modes in only one of them are left
    out)."""
    table = Table(title=f"plan vs bench, {workload}", title_justify="left")
    for name in ("mode", "plan ms", "bench ms", "bench min-max", "error", "plan x", "bench x"):
        table.add_column(name, justify="left" if name == "mode" else "right", no_wrap=True)
    bench = measured["modes"]
    for mode in (m for m in plans if m in bench):
        p, b = plans[mode].seconds, bench[mode]["median_s"]
        times = bench[mode].get("times_s") or [b]
        table.add_row(
            mode,
            f"{p * 1e3:.1f}",
            f"{b * 1e3:.1f}",
            f"{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}",
            f"{(p - b) / b:+.1%}",
            f"{plans[NONE.name].seconds / p:.2f}x",
            f"{bench[mode]['speedup']:.2f}x",
        )
    table.caption = "error: (plan - bench) / bench, on the bench's median"
    table.caption_justify = "left"
    return table
