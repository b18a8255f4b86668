"""The online benchmark: a Poisson stream of streamed completions against any OpenAI-compatible
server (ours, vLLM's or SGLang's), and its latencies and throughput with vLLM's metric names.

Each request is one thread reading the server-sent events with ``http.client``; the requests
(random token ids, their lengths from a dataset) come from ``bench_datasets.py``. Output tokens
are counted from the stream's ``usage`` (``stream_options.include_usage``), so no field of our
own is needed.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rich.progress import Progress

from moe_overlap.tools.bench_datasets import BenchRequest
from moe_overlap.tools.serving_metrics import RequestTiming, percentile, samples_ms, summarize


@dataclass(frozen=True)
class Target:
    """Where the load goes: a server's root URL (``http://host:port``), its key and model."""

    base_url: str
    api_key: str | None = None
    model: str | None = None  # the request's ``model``; None: the server's only model
    local: bool = True  # the server runs below this process: its memory is ours to read

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        url = urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        return kind(url.hostname or "127.0.0.1", url.port, timeout=timeout)

    def path(self, route: str) -> str:
        prefix = urlsplit(self.base_url).path.rstrip("/").removesuffix("/v1")
        return f"{prefix}{route}"

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


@dataclass(frozen=True)
class SpecCounts:
    """Speculative decoding's counters in our server's ``/metrics``."""

    verifications: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def since(self, before: SpecCounts) -> SpecCounts:
        return SpecCounts(*(a - b for a, b in zip(astuple(self), astuple(before), strict=True)))


_SPEC_METRICS = {f"moe_overlap_spec_{name}": name for name in SpecCounts.__dataclass_fields__}


@dataclass
class LoadResult:
    mode: str
    rate: float  # requests per second offered (inf: all at once)
    max_concurrency: int | None
    summary: dict  # vLLM's result keys (serving_metrics.summarize)
    ttft_ms: tuple[float, float]  # p50, p99
    itl_ms: tuple[float, float]  # p50, p99
    rss_mib: tuple[float, float] = (float("nan"), float("nan"))  # before, after (with ranks)
    spec: SpecCounts | None = None  # over this load; None: the server counts no speculation

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verification, the bonus token included; None where none verified."""
        if self.spec is None or not self.spec.verifications:
            return None
        return (self.spec.accepted_tokens + self.spec.verifications) / self.spec.verifications

    @property
    def draft_acceptance(self) -> float:
        """The share of draft tokens accepted."""
        spec = self.spec or SpecCounts()
        return spec.accepted_tokens / spec.draft_tokens if spec.draft_tokens else 0.0

    @property
    def requests(self) -> int:
        return self.summary["completed"] + self.summary["failed"]

    @property
    def errors(self) -> int:
        return self.summary["failed"]

    @property
    def output_tokens(self) -> int:
        return self.summary["total_output_tokens"]

    @property
    def tokens_per_s(self) -> float:
        return self.summary["output_throughput"]

    @property
    def requests_per_s(self) -> float:
        return self.summary["request_throughput"]

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "request_rate": self.rate if self.rate != float("inf") else "inf",
            "max_concurrency": self.max_concurrency,
            **self.summary,
            "rss_mib": [None if math.isnan(m) else m for m in self.rss_mib],  # JSON has no NaN
            "spec_acceptance_length": self.acceptance_length,
            "spec_draft_acceptance": (
                self.draft_acceptance if self.acceptance_length is not None else None
            ),
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_model(target: Target) -> str:
    """The id of the model a server serves (its first, as ``/v1/models`` lists them)."""
    conn = target.connection(timeout=30)
    try:
        conn.request("GET", target.path("/v1/models"), headers=target.headers())
        status, body = (resp := conn.getresponse()).status, resp.read()
    except (OSError, http.client.HTTPException) as exc:  # named: not a bare "refused"
        raise ConnectionError(f"cannot reach the server at {target.base_url}: {exc}") from None
    finally:
        conn.close()
    if status != 200:
        raise ConnectionError(f"{target.base_url}/v1/models: HTTP {status} {body[:200]!r}")
    return json.loads(body)["data"][0]["id"]


def cache_hit_rate(target: Target) -> float | None:
    """The share of prompt tokens the server found in its prefix cache since it started
    (SGLang's ``cache_hit_rate`` in ``/get_server_info``), or None where it reports none."""
    conn = target.connection(timeout=30)
    try:
        conn.request("GET", target.path("/get_server_info"), headers=target.headers())
        resp = conn.getresponse()
        body = resp.read()
        return json.loads(body).get("cache_hit_rate") if resp.status == 200 else None
    finally:
        conn.close()


def spec_counts(target: Target) -> SpecCounts | None:
    """Speculative decoding's counters in the server's ``/metrics`` (ours), or None where it
    has no such page or counters (another server)."""
    conn = target.connection(timeout=30)
    try:
        conn.request("GET", target.path("/metrics"), headers=target.headers())
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    found = {}
    for line in body.splitlines() if resp.status == 200 else []:
        name, _, value = line.partition(" ")
        if name in _SPEC_METRICS:
            found[_SPEC_METRICS[name]] = float(value)
    return SpecCounts(**found) if len(found) == len(_SPEC_METRICS) else None


def run_load(
    target: Target,
    requests: list[BenchRequest],
    rate: float,
    seed: int,
    mode: str = "",
    max_concurrency: int | None = None,
    metrics: tuple[list[str], list[float]] = (["ttft", "tpot", "itl"], [99.0]),
    progress: bool = False,
) -> LoadResult:
    """Send ``requests`` as Poisson arrivals at ``rate`` per second (at most ``max_concurrency``
    in flight); wait for every answer. ``progress``: a bar of the answers, on a terminal."""
    rng = random.Random(seed)
    model = target.model or served_model(target)
    rss = rss_mib if target.local else lambda: float("nan")  # another host's is not ours
    rss_before, spec_before = rss(), spec_counts(target)
    gate = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    workers = min(len(requests), max_concurrency or 256)
    bar = Progress(disable=not progress, transient=True)
    answered = bar.add_task(f"{mode} at {rate:g}/s", total=len(requests))
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        for request in requests:
            if gate is not None:
                gate.acquire()
            timing = RequestTiming(time.perf_counter(), len(request.prompt))
            timings.append(timing)
            done = pool.submit(_stream, target, model, request, timing, gate)
            done.add_done_callback(lambda _: bar.advance(answered))
            time.sleep(rng.expovariate(rate) if rate != float("inf") else 0.0)
    ends = [t.chunks[-1] for t in timings if t.chunks]
    spec_after = spec_counts(target)
    spec = spec_after.since(spec_before) if spec_after and spec_before else None
    samples = samples_ms(timings)
    return LoadResult(
        mode,
        rate,
        max_concurrency,
        summarize(timings, (max(ends) - start) if ends else 0.0, *metrics),
        (percentile(samples["ttft"], 50), percentile(samples["ttft"], 99)),
        (percentile(samples["itl"], 50), percentile(samples["itl"], 99)),
        (rss_before, rss()),
        spec,
    )


def rss_mib() -> float:
    """Resident memory of this process and every process below it (the ranks are children of
    the rank fork server), in MiB."""
    pids = [os.getpid(), *_descendants(os.getpid())]
    pages = 0
    for pid in pids:
        try:
            pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or no /proc here
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found + [d for c in found for d in _descendants(c)]


def _stream(
    target: Target,
    model: str,
    request: BenchRequest,
    timing: RequestTiming,
    gate: threading.BoundedSemaphore | None,
) -> None:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,  # vLLM's and SGLang's extension, as their benches send it
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        conn = target.connection(timeout=600)
        conn.request("POST", target.path("/v1/completions"), json.dumps(body), target.headers())
        resp = conn.getresponse()
        if resp.status != 200:
            timing.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        _read_events(resp, timing)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
    finally:
        if gate is not None:
            gate.release()


def _read_events(resp: http.client.HTTPResponse, timing: RequestTiming) -> None:
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            timing.error = event["error"].get("message", str(event["error"]))
            return
        if event.get("choices"):  # a token's chunk (its text may be empty mid-character)
            timing.chunks.append(time.perf_counter())
        usage = event.get("usage") or usage
    timing.output_tokens = usage["completion_tokens"] if usage else len(timing.chunks)
    if not timing.chunks:
        timing.error = "the stream ended without a token"
