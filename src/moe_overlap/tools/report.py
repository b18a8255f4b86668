"""The bench's table: what a user reads first."""

from __future__ import annotations

from rich.table import Table

from moe_overlap.tools.bench import BenchReport


def bench_table(report: BenchReport, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("mode", no_wrap=True)
    for name in ("tokens/s", "ms/forward", "min-max ms", "speed-up", "hidden"):
        table.add_column(name, justify="right", no_wrap=True)
    for mode, r in report.results.items():
        hidden = report.overlap(mode).hidden_share
        table.add_row(
            mode,
            f"{report.workload.tokens / r.median:,.0f}",
            f"{r.median * 1e3:.1f}",
            f"{min(r.times) * 1e3:.0f}-{max(r.times) * 1e3:.0f}",
            f"{report.speedup(mode):.2f}x",
            "-" if hidden is None else f"{hidden:.0%}",
        )
    table.caption = (
        f"T_comp {report.t_comp * 1e3:.1f} ms, T_comm {report.t_comm * 1e3:.1f} ms "
        f"(from the no-overlap forwards), physical limit max(T_comp, T_comm) = "
        f"{report.limit * 1e3:.1f} ms; hidden: the share of the time an all-to-all was "
        "in flight while some micro-batch computed, in the mode's recorded forward"
    )
    table.caption_justify = "left"
    return table
