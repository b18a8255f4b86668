"""bench-serve's report: the table of every mode and rate, and the closing notes of
``--compare-prefix-caching`` and ``--compare-speculative``, each a run against its twin
without the feature."""

from __future__ import annotations

import math
from collections.abc import Iterator

from rich.table import Table

from moe_overlap.tools.bench_serve import LoadResult

NO_PREFIX_CACHE = " no-prefix-cache"  # the label suffix of a server run without the feature
NO_SPECULATION = " no-spec"


def load_table(results: list[LoadResult], title: str) -> Table:
    table = Table(title=title)
    for column in ("mode", "rate/s", "done/s", "tokens/s", "TTFT p50", "TTFT p99"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for column in ("ITL p50", "ITL p99", "errors", "RSS MiB"):
        table.add_column(column, justify="right")
    speculated = any(r.acceptance_length is not None for r in results)
    if speculated:
        table.add_column("accept len", justify="right")
    for r in results:
        table.add_row(
            r.mode,
            f"{r.rate:g}",
            f"{r.requests_per_s:.2f}",
            f"{r.tokens_per_s:,.0f}",
            *(f"{v:.0f} ms" for v in (*r.ttft_ms, *r.itl_ms)),
            str(r.errors),
            "-" if math.isnan(r.rss_mib[0]) else f"{r.rss_mib[0]:,.0f}->{r.rss_mib[1]:,.0f}",
            *([_acceptance(r)] if speculated else []),
        )
    return table


def _pairs(
    results: list[LoadResult], suffix: str
) -> Iterator[tuple[str, float, LoadResult, LoadResult]]:
    """Each (mode, rate) run with the feature on, beside its run labelled ``mode + suffix``."""
    by_label = {(r.mode, r.rate): r for r in results}
    for (label, rate), on in by_label.items():
        off = by_label.get((label + suffix, rate))
        if off is not None:
            yield label, rate, on, off


def prefix_caching_note(results: list[LoadResult]) -> str:
    """The closing note of --compare-prefix-caching: per mode and rate, TTFT p50 and output
    throughput with the cache against without it."""
    lines = ["prefix caching on against off (the same prompts, the same rates):"]
    for label, rate, on, off in _pairs(results, NO_PREFIX_CACHE):
        lines.append(
            f"  {label} at {rate:g}/s: TTFT p50 {off.ttft_ms[0]:.0f} -> {on.ttft_ms[0]:.0f} ms "
            f"({off.ttft_ms[0] / max(on.ttft_ms[0], 1e-9):.2f}x), output "
            f"{off.tokens_per_s:,.0f} -> {on.tokens_per_s:,.0f} tokens/s "
            f"({on.tokens_per_s / max(off.tokens_per_s, 1e-9):.2f}x)"
        )
    return "\n".join(lines)


def speculative_note(results: list[LoadResult]) -> str:
    """The closing note of --compare-speculative: per mode and rate, output tokens/s and ITL
    p50 with speculative decoding against without it, and its acceptance length."""
    lines = ["speculative decoding on against off (the same prompts, the same rates):"]
    for label, rate, on, off in _pairs(results, NO_SPECULATION):
        lines.append(
            f"  {label} at {rate:g}/s: output {off.tokens_per_s:,.0f} -> "
            f"{on.tokens_per_s:,.0f} tokens/s "
            f"({on.tokens_per_s / max(off.tokens_per_s, 1e-9):.2f}x), ITL p50 "
            f"{off.itl_ms[0]:.0f} -> {on.itl_ms[0]:.0f} ms, acceptance length "
            f"{_acceptance(on)}"
        )
    return "\n".join(lines)


def _acceptance(r: LoadResult) -> str:
    """Tokens per verification (the bonus included), and the share of drafts accepted."""
    if r.acceptance_length is None:
        return "-"
    return f"{r.acceptance_length:.2f} ({r.draft_acceptance:.0%})"
