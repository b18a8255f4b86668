"""An online benchmark's figures, with vLLM's names: its result block and its JSON keys, so
scripts written for ``vllm bench serve`` read ours.

TTFT: request sent to its first streamed token. TPOT: the rest of the answer's time over its
tokens after the first. ITL: the gaps between streamed chunks. E2EL: request sent to last token.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

METRICS = {  # name -> its heading in the result block
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestTiming:
    """One streamed request, as the client saw it (``time.perf_counter`` seconds)."""

    sent: float
    prompt_tokens: int
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    output_tokens: int = 0  # from the server's usage, else one per chunk
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)


def parse_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {','.join(METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: comma-separated numbers in (0, 100]")
    return values


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def samples_ms(timings: list[RequestTiming]) -> dict[str, list[float]]:
    """Each metric's samples over the successful requests, in milliseconds."""
    done = [t for t in timings if t.ok]
    return {
        "ttft": [(t.chunks[0] - t.sent) * 1e3 for t in done],
        "tpot": [
            (t.chunks[-1] - t.chunks[0]) * 1e3 / (t.output_tokens - 1)
            for t in done
            if t.output_tokens > 1
        ],
        "itl": [(b - a) * 1e3 for t in done for a, b in zip(t.chunks, t.chunks[1:], strict=False)],
        "e2el": [(t.chunks[-1] - t.sent) * 1e3 for t in done],
    }


def summarize(
    timings: list[RequestTiming],
    duration_s: float,
    metrics: list[str],
    percentiles: list[float],
) -> dict:
    """vLLM's result keys for one load: counts, throughputs, and for each chosen metric its
    mean, median, standard deviation and chosen percentiles."""
    done = [t for t in timings if t.ok]
    inputs = sum(t.prompt_tokens for t in done)
    outputs = sum(t.output_tokens for t in done)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(timings) - len(done),
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(outputs),
        "total_token_throughput": per_s(inputs + outputs),
        "input_lens": [t.prompt_tokens for t in timings],
        "output_lens": [t.output_tokens if t.ok else 0 for t in timings],
        "errors": [t.error or "" for t in timings],
    }
    samples = samples_ms(timings)
    result["ttfts"] = [v / 1e3 for v in samples["ttft"]]
    result["itls"] = [v / 1e3 for v in samples["itl"]]
    for name in metrics:
        values = samples[name]
        result[f"mean_{name}_ms"] = statistics.fmean(values) if values else float("nan")
        result[f"median_{name}_ms"] = statistics.median(values) if values else float("nan")
        result[f"std_{name}_ms"] = statistics.pstdev(values) if values else float("nan")
        for p in percentiles:
            result[f"p{p:g}_{name}_ms"] = percentile(values, p)
    return result


def result_block(result: dict, metrics: list[str], percentiles: list[float]) -> str:
    """The result block as ``vllm bench serve`` prints it."""
    rows = [
        ("Successful requests:", f"{result['completed']}"),
        ("Failed requests:", f"{result['failed']}"),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", f"{result['total_input_tokens']}"),
        ("Total generated tokens:", f"{result['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines += [f"{label:<40}{value:<10}" for label, value in rows]
    for name in metrics:
        upper = name.upper()
        lines.append("{s:{c}^{n}}".format(s=METRICS[name], n=50, c="-"))
        lines.append(f"{f'Mean {upper} (ms):':<40}{result[f'mean_{name}_ms']:<10.2f}")
        lines.append(f"{f'Median {upper} (ms):':<40}{result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            lines.append(f"{f'P{p:g} {upper} (ms):':<40}{result[f'p{p:g}_{name}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)
