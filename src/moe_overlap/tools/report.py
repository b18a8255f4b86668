"""The bench's table: what a user reads first."""

from __future__ import annotations

from rich.table import Table

from moe_overlap.tools.bench import BenchReport

HIDDEN_CPU = (
    "the share of the time the MoE's communication was in flight while some micro-batch "
    "computed, in the mode's recorded forward"
)
HIDDEN_GPU = (
    "(T_none - T_mode) / T_comm, the communication time the mode took off the forward (on "
    "CUDA the compute spans are host launch times)"
)


def bench_table(
    report: BenchReport, title: str, bounds: dict[str, float | None] | None = None
) -> Table:
    """The modes' figures; ``bounds``: per mode the planner's zero-host-cost bound of its
    stage order (``tools/bench_bounds.py``), shown as each mode's share of it."""
    table = Table(title=title, title_justify="left")
    table.add_column("mode", no_wrap=True, min_width=max(map(len, report.results)))
    bounded = bounds is not None and any(b is not None for b in bounds.values())
    columns = ("tokens/s", "ms/forward", "min-max ms", "speed-up", "hidden", "of limit")
    for name in columns + (("of 0-host",) if bounded else ()):
        table.add_column(name, justify="right")  # a narrow terminal wraps these, not modes
    marked = [m for m in report.results if report.notes.get(m)]
    for mode, r in report.results.items():
        hidden, bound = report.hidden(mode), (bounds or {}).get(mode)
        row = [
            f"{mode} [{marked.index(mode) + 1}]" if mode in marked else mode,
            f"{report.workload.tokens / r.median:,.0f}",
            f"{r.median * 1e3:.1f}",
            f"{min(r.times) * 1e3:.0f}-{max(r.times) * 1e3:.0f}",
            f"{report.speedup(mode):.2f}x",
            "-" if hidden is None else f"{hidden:.0%}",
            f"{report.limit_share(mode):.0%}",
        ]
        if bounded:
            row.append("-" if bound is None else f"{bound / r.median:.0%}")
        table.add_row(*row)
    tp = ""
    if report.t_tp_comm:
        tp = f" + T_tp {report.t_tp_comm * 1e3:.1f} ms (attention-TP all-reduce/all-gather)"
    table.caption = (
        f"T_comp {report.t_comp * 1e3:.1f} ms, T_comm {report.t_comm * 1e3:.1f} ms (MoE "
        f"all-to-all or gather/all-reduce){tp}, from the no-overlap forwards; physical limit "
        f"max(T_comp, T_comm){' + T_tp' if tp else ''} = {report.limit * 1e3:.1f} ms; of "
        f"limit: limit / ms per forward; hidden: {HIDDEN_GPU if report.on_gpu else HIDDEN_CPU}"
    )
    if bounded:
        table.caption += (
            "; of 0-host: the bound the mode's stage order allows with no host cost (the "
            "planner's, from T_comp and T_comm) / ms per forward"
        )
    for i, mode in enumerate(marked, start=1):
        table.caption += f"\n[{i}] {mode}: {'; '.join(report.notes[mode])}"
    table.caption_justify = "left"
    return table


def dtype_table(reports: dict[str, BenchReport], title: str) -> Table:
    """``bench --compare-dispatch-dtype``: each dispatch dtype's ``T_comm`` and ``T_comp``
    (from its own no-overlap forwards) and each mode's speed-up over that dtype's none; the
    last column, the first dtype's ``T_none`` over each mode's time under the second."""
    (a, first), (b, second) = reports.items()
    table = Table(title=f"{title}: dispatch {a} against {b}", title_justify="left")
    table.add_column("mode", no_wrap=True)
    for name in (f"{a} ms", f"{a} speed-up", f"{b} ms", f"{b} speed-up", f"{a} none / {b}"):
        table.add_column(name, justify="right")
    for mode in first.results:
        table.add_row(
            mode,
            f"{first.results[mode].median * 1e3:.1f}",
            f"{first.speedup(mode):.2f}x",
            f"{second.results[mode].median * 1e3:.1f}",
            f"{second.speedup(mode):.2f}x",
            f"{first.t_none / second.results[mode].median:.2f}x",
        )
    table.caption = "; ".join(
        f"{name}: T_comm {r.t_comm * 1e3:.1f} ms, T_comp {r.t_comp * 1e3:.1f} ms, "
        f"{r.comm_bytes / 1e6:.2f} MB a forward on the busiest rank's link"
        for name, r in reports.items()
    ) + (
        f"; T_comm {b} / {a} = {_ratio(second.t_comm, first.t_comm)}, bytes {b} / {a} = "
        f"{_ratio(second.comm_bytes, first.comm_bytes)}"
    )
    table.caption_justify = "left"
    return table


def _ratio(x: float, y: float) -> str:
    return f"{x / y:.2f}" if y > 0 else "-"
