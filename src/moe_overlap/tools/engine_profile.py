"""Where an engine's time goes: a profiled run split into matrix multiplies, attention, the
other operators and the time outside any operator (Python, scheduling, sampling, and the
profiler's own cost per operator), with the matrix multiplies' throughput beside this CPU's
peak, measured in the same run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

# operators whose own time is a matrix multiply (transformers' experts call _grouped_mm, which
# on CPU runs mm per expert: both are counted, each for its own time)
MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm"}


@dataclass
class Breakdown:
    wall_s: float  # the best time without the profiler
    profiled_wall_s: float  # the fastest profiled run's, profiler costs included
    matmul_s: float
    attention_s: float
    other_ops_s: float
    matmul_gflops: float  # achieved by the matrix multiplies whose FLOPs torch counts

    @property
    def outside_ops_s(self) -> float:
        """The profiled run's time outside any operator (the profiler's own cost included)."""
        return max(0.0, self.profiled_wall_s - self.matmul_s - self.attention_s - self.other_ops_s)


def profiled(run: Callable[[], object], wall_s: float, repeats: int) -> Breakdown:
    """The fastest of ``repeats`` profiled runs of ``run`` (on a shared machine the slower runs
    measure the neighbours), split by operator kind, beside ``wall_s``, the best time of ``run``
    without the profiler."""
    fastest = min((_profiled_once(run) for _ in range(repeats)), key=lambda b: b.profiled_wall_s)
    return replace(fastest, wall_s=wall_s)


def _profiled_once(run: Callable[[], object]) -> Breakdown:
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        run()
    wall = time.perf_counter() - start
    matmul = attention = other = flops = counted = 0.0
    for event in prof.key_averages():
        own = event.self_cpu_time_total / 1e6
        if event.key in MATMULS:
            matmul += own
            if event.flops:  # torch counts mm's and bmm's FLOPs, not _grouped_mm's
                flops, counted = flops + event.flops, counted + own
        elif "scaled_dot_product" in event.key:
            attention += own
        else:
            other += own
    gflops = flops / counted / 1e9 if counted else 0.0
    return Breakdown(wall, wall, matmul, attention, other, gflops)


def peak_matmul_gflops(size: int = 1536, repeats: int = 20) -> float:
    """This CPU's fp32 matrix-multiply throughput on a large square product (best of
    ``repeats``), the ceiling any engine's matrix multiplies can reach here."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def breakdown_table(rows: list[tuple[str, str, Breakdown]], peak: float, repeats: int) -> Table:
    """One row per (case, engine): seconds and shares of the fastest of ``repeats`` profiled
    runs."""
    table = Table(
        title=f"Where the time goes: the fastest of {repeats} profiled runs (this CPU's fp32 "
        "matmul peak "
        f"{peak:.0f} GFLOPS)",
        title_justify="left",
    )
    columns = ("case", "engine", "best s", "prof s", "mm", "attn", "other", "outside")
    for col in columns:
        left = col in ("case", "engine")
        table.add_column(col, justify="left" if left else "right", no_wrap=left)
    table.add_column("GFLOPS", justify="right")
    for case, engine, b in rows:
        parts = (b.matmul_s, b.attention_s, b.other_ops_s, b.outside_ops_s)
        table.add_row(
            case,
            engine,
            f"{b.wall_s:.3f}",
            f"{b.profiled_wall_s:.3f}",
            *(f"{part / b.profiled_wall_s:.0%}" for part in parts),
            f"{b.matmul_gflops:.0f}",
        )
    table.caption = (
        "best s: the best time without the profiler; shares of the profiled run (prof s): mm, matrix "
        "multiplies, attention, other operators, outside any operator (Python, scheduling, the "
        "profiler's own cost per operator); GFLOPS: the matrix multiplies' own throughput"
    )
    return table
