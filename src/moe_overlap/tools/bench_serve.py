"""The online benchmark: a Poisson stream of streamed completions against a running server, and
its latencies (time to first token, inter-token latency) and throughput.

Each request is one thread reading the server-sent events with ``http.client``; a request's
prompt is random token ids of a length drawn from the bench's workload grammar.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moe_overlap.tools.workloads import parse_workload

FIRST_ID = 3  # prompts avoid the shipped tokenizer's special tokens (ids 0-2)


@dataclass
class RequestTiming:
    sent: float
    tokens: list[float] = field(default_factory=list)  # arrival time of each token's event
    error: str | None = None


@dataclass
class LoadResult:
    mode: str
    rate: float  # requests per second offered
    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    ttft_ms: tuple[float, float]  # p50, p99
    itl_ms: tuple[float, float]  # p50, p99
    rss_mib: tuple[float, float] = (float("nan"), float("nan"))  # before, after (with ranks)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return (self.requests - self.errors) / self.duration_s if self.duration_s else 0.0

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
        }


def prompt_lengths(workload: str, count: int, seed: int) -> list[int]:
    """``count`` prompt lengths drawn from a workload spec (``uniform:30-3072``, ...)."""
    lengths: list[int] = []
    draw = seed
    while len(lengths) < count:
        lengths += [n for rank in parse_workload(workload, 1, draw).lengths for n in rank]
        draw += 1
    return lengths[:count]


def make_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(n)] for n in lengths]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_load(
    port: int,
    prompts: list[list[int]],
    rate: float,
    output_len: int,
    seed: int,
    api_key: str | None = None,
    mode: str = "",
) -> LoadResult:
    """Send ``prompts`` as Poisson arrivals at ``rate`` per second; wait for every answer."""
    rng = random.Random(seed)
    rss_before = rss_mib()
    timings: list[RequestTiming] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(len(prompts), 256)) as pool:
        for prompt in prompts:
            timing = RequestTiming(time.perf_counter())
            timings.append(timing)
            pool.submit(_stream, port, prompt, output_len, api_key, timing)
            time.sleep(rng.expovariate(rate))
    ends = [t.tokens[-1] for t in timings if t.tokens]
    ttft = [(t.tokens[0] - t.sent) * 1e3 for t in timings if t.tokens and not t.error]
    itl = [
        (b - a) * 1e3
        for t in timings
        if not t.error
        for a, b in zip(t.tokens, t.tokens[1:], strict=False)
    ]
    return LoadResult(
        mode,
        rate,
        len(prompts),
        sum(1 for t in timings if t.error),
        (max(ends) - start) if ends else 0.0,
        sum(len(t.tokens) for t in timings if not t.error),
        (percentile(ttft, 50), percentile(ttft, 99)),
        (percentile(itl, 50), percentile(itl, 99)),
        (rss_before, rss_mib()),
    )


def rss_mib() -> float:
    """Resident memory of this process and its children (spawned ranks), in MiB."""
    pids = [os.getpid(), *_children(os.getpid())]
    pages = 0
    for pid in pids:
        try:
            pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or no /proc here
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def _stream(
    port: int, prompt: list[int], output_len: int, key: str | None, timing: RequestTiming
) -> None:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            timing.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                timing.error = event["error"]["message"]
                return
            now = time.perf_counter()
            timing.tokens += [now] * len(event["choices"][0].get("token_ids", []))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
