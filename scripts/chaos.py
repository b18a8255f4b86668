"""Chaos run for the server: a load of mixed requests while faults are injected, one phase per
fault, each against a fresh ``moe-overlap serve --ep 2`` of a tiny model on CPU.

Each fault lands while requests are in flight: the phase waits until the server's /health
counts at least --in-flight running requests, fires, and prints how many were running then.
Every request ends in one of: answered (a whole answer, or a stream ending in [DONE]), wrong
(answered, but with text that differs from the same request's answer on an idle server, asked
alone before the phases), errored with a reason (an OpenAI error body or stream error event,
then [DONE]), lost (no answer, an answer not in the OpenAI shape, or a stream cut without
[DONE]) or hung (nothing within --client-timeout); "refused" counts connections tried after
the server exited (a dead rank stops it). Wrong, lost and hung must be 0. The server's and
its ranks' memory is read before the load and after it. Hostile clients (trickled headers, stalled bodies,
a connection flood) are counted apart: they must be cut off, and the server's memory must come
back near where it was once they leave.

    PYTHONPATH=src:. python scripts/chaos.py [--requests 40] [--client-timeout 60]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_overlap import ModelConfig
from moe_overlap.engine.tokenizer import write_tokenizer
from moe_overlap.model.loader import build_model, save_checkpoint
from tests.helpers import TINY

CFG = {**TINY["qwen3_moe"], "vocab_size": 320, "max_position_embeddings": 1024, "eos_token_id": 1}
BAD = [  # requests a single client can send that must fail alone, with a reason
    b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e-39}',  # served: greedy
    b'{"prompt": "hi", "max_tokens": 4, "top_p": 1e-300}',  # served
    b'{"prompt": "hi \\ud800"}',
    b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
    b'{"prompt": "hi", "seed": 18446744073709551616}',
    json.dumps({"prompt": "hi", "stop": ["x" * 150] * 5000}).encode(),  # 413 or 400
    json.dumps({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(),
    b'{"prompt": [true, 5]}',
    b"{not json",
]


def serve(model: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "moe_overlap.tools.cli", "serve", "--model", str(model)]
    cmd += ["--ep", "2", "--port", str(port), "--timeout", "5", "--max-num-seqs", "8"]
    cmd += ["--header-timeout", "2", "--body-timeout", "2", "--shutdown-timeout", "1"]
    cmd += ["--max-buffered-bytes", str(16 << 20)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while "serving" not in proc.stderr.readline():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
    proc.reader = threading.Thread(target=_keep, args=(proc,), daemon=True)  # type: ignore[attr-defined]
    proc.reader.start()  # type: ignore[attr-defined]
    return proc


def _keep(proc: subprocess.Popen) -> None:
    proc.log = proc.stderr.read()  # type: ignore[attr-defined]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kib / 1024


def ask(port: int, body: bytes, path: str, timeout: float) -> tuple[str, str | None]:
    """One request's outcome ("answered", "error:<code>", "lost:<why>", "hung" or "refused")
    and, when answered, the answer's text (a stream's chunks joined)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except TimeoutError:
        return "hung", None
    except ConnectionRefusedError:  # the server had already exited (a dead rank stops it)
        return "refused", None
    except (OSError, http.client.HTTPException) as exc:
        return f"lost:{type(exc).__name__}", None
    if resp.getheader("content-type", "").startswith("text/event-stream"):
        lines = [ln for ln in raw.decode().splitlines() if ln]
        if not lines or lines[-1] != "data: [DONE]":
            return "lost:stream cut", None
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        errors = [e["error"] for e in events if "error" in e]
        if errors:
            return f"error:{errors[0]['code']}", None
        return "answered", "".join(c["text"] for e in events for c in e.get("choices", []))
    try:
        reply = json.loads(raw)
    except ValueError:
        return "lost:not json", None
    if resp.status == 200 and reply.get("choices"):
        return "answered", reply["choices"][0]["text"]
    if "error" in reply and reply["error"].get("message"):
        return f"error:{reply['error']['code']}", None
    return "lost:bad shape", None


def jobs(count: int, seed: int) -> list[tuple[bytes, str]]:
    """``count`` requests: every fourth a bad one (it must fail alone, with a reason), the rest
    seeded completions (greedy or sampled, streamed or not) long enough to be in flight."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 4 == 3:
            bad = BAD[i // 4 % len(BAD)]
            out.append((bad, "/v1/chat/completions" if b"messages" in bad else "/v1/completions"))
            continue
        body = {"prompt": f"Question {i}: where?", "max_tokens": rng.randint(16, 128)}
        body |= {"stream": rng.random() < 0.5, "temperature": rng.choice([0, 0.7])}
        body |= {"seed": i, "ignore_eos": True}
        out.append((json.dumps(body).encode(), "/v1/completions"))
    return out


def solo_answers(port: int, work: list[tuple[bytes, str]], timeout: float) -> dict[int, str]:
    """Each good request's answer on an idle server, asked one at a time."""
    answers = {}
    for i, (body, path) in enumerate(work):
        if i % 4 != 3:
            outcome, text = ask(port, body, path, timeout)
            if outcome != "answered" or text is None:
                raise RuntimeError(f"request {i} failed on an idle server: {outcome}")
            answers[i] = text
    return answers


def mixed(port: int, work: list[tuple[bytes, str]], timeout: float, solo: dict[int, str]):
    """Send ``work`` 16 at a time; each outcome, "wrong" where an answer's text is not
    ``solo``'s."""
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda j: ask(port, j[0], j[1], timeout), work))
    return [
        "wrong" if outcome == "answered" and i in solo and text != solo[i] else outcome
        for i, (outcome, text) in enumerate(replies)
    ]


def hostile(port: int, count: int) -> Counter:
    """Trickled headers, stalled 1 MiB bodies and a burst of idle connections; how each ended."""
    socks, seen = [], Counter()
    for i in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 3 == 0:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        elif i % 3 == 1:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1048576\r\n\r\n"
            )
            s.sendall(b"x" * (512 << 10))
        socks.append(s)
    deadline = time.monotonic() + 10
    for s in socks:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            data = s.recv(4096)
            seen[
                "cut off"
                if not data or data.startswith(b"HTTP/1.1 4") or data.startswith(b"HTTP/1.1 503")
                else "other"
            ] += 1
        except ConnectionResetError:
            seen["cut off"] += 1
        except TimeoutError:
            seen["still held"] += 1
        s.close()
    return seen


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def rank_pids(pid: int) -> list[int]:
    """The server's ranks: children of its fork server (its one child), in rank order."""
    (zygote,) = children(pid)
    return children(zygote)


def running(port: int) -> int:
    """Requests in the server's batch, by its /health (0 once it does not answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return int(json.loads(conn.getresponse().read()).get("running", 0))
    except (OSError, ValueError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def memory(proc: subprocess.Popen) -> tuple[float, float] | None:
    """(the server's RSS, its ranks' together) in MiB; None once it has exited."""
    if proc.poll() is not None:
        return None
    try:
        return rss_mib(proc.pid), sum(rss_mib(p) for p in rank_pids(proc.pid))
    except (OSError, ValueError):  # a rank or the fork server is gone
        return rss_mib(proc.pid), float("nan")


def land(fault, proc: subprocess.Popen, port: int, want: int, load: threading.Thread):
    """Fire ``fault`` once ``want`` requests are running (or the load is about to end);
    (what it returned, how many were running as it fired)."""
    deadline = time.monotonic() + 30
    while (now := running(port)) < want and load.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    return fault(proc, port), now


def phase(model: Path, name: str, args: argparse.Namespace, fault, solo) -> dict:
    port = free_port()
    proc = serve(model, port)
    work = jobs(args.requests, 1)
    try:
        mixed(port, jobs(8, 0), args.client_timeout, {})  # warm up before the baseline
        before = memory(proc)
        result: dict = {}
        load = threading.Thread(
            target=lambda: result.update(out=mixed(port, work, args.client_timeout, solo))
        )
        load.start()
        hostile_seen, in_flight = land(fault, proc, port, args.in_flight, load)
        load.join()
        time.sleep(2.0)
        after = memory(proc)
    finally:
        try:
            proc.wait(0 if name.startswith("bad") else 15)  # a dead rank stops the server
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        proc.reader.join(15)  # type: ignore[attr-defined]
    return _row(name, result["out"], hostile_seen, in_flight, (before, after), code, proc)


def _row(name, out, hostile_seen, in_flight, rss, code, proc) -> dict:
    outcomes = Counter(o.split(":")[0] for o in out)
    reasons = Counter(o.split(":", 1)[1] for o in out if o.startswith("error:"))
    log = getattr(proc, "log", "(stderr still open: not read)")
    return {
        "phase": name,
        "sent": len(out),
        "in_flight": in_flight,
        **{k: outcomes.get(k, 0) for k in ("answered", "wrong", "error", "lost", "hung")},
        "refused": outcomes.get("refused", 0),
        "reasons": dict(reasons),
        "lost_why": [o for o in out if o.startswith("lost")],
        "hostile": dict(hostile_seen or {}),
        "rss": rss,
        "exit": code,
        "tracebacks": log.count("Traceback"),
        "last": log.strip().splitlines()[-1][:150] if log.strip() else "",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def solo_run(model: Path, args: argparse.Namespace) -> dict[int, str]:
    """Every good request of the phases' load, asked alone on an idle server of its own."""
    port = free_port()
    proc = serve(model, port)
    try:
        return solo_answers(port, jobs(args.requests, 1), args.client_timeout)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _mib(pair: tuple[float, float] | None) -> str:
    return "(exited)" if pair is None else f"{pair[0]:.0f} + {pair[1]:.0f}"


def print_rows(rows: list[dict]) -> None:
    table = Table(title="chaos: one fresh `serve --ep 2` per phase")
    columns = ["phase", "sent", "running at fault", "answered", "wrong", "errored", "lost"]
    columns += ["hung", "refused", "MiB before", "MiB after", "exit", "tracebacks"]
    for c in columns:
        table.add_column(c, justify="left" if c == "phase" else "right")
    for r in rows:
        counts = [r[k] for k in ("sent", "in_flight", "answered", "wrong", "error", "lost")]
        counts += [r["hung"], r["refused"]]
        table.add_row(
            r["phase"], *map(str, counts), _mib(r["rss"][0]), _mib(r["rss"][1]),
            str(r["exit"]), str(r["tracebacks"]),
        )  # fmt: skip
    console = Console(width=200)
    console.print(table)
    console.print("MiB: the server's RSS + its ranks' together, before the load and 2 s after")
    for r in rows:
        console.print(f"{r['phase']}: reasons {r['reasons']}; last words: {r['last']}")
        if r["hostile"]:
            console.print(f"    hostile connections: {r['hostile']}")
        if r["lost_why"]:
            console.print(f"    lost: {Counter(r['lost_why'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="mixed requests per phase")
    parser.add_argument("--hostile", type=int, default=150, help="hostile connections")
    parser.add_argument("--client-timeout", type=float, default=60.0, help="seconds = hung")
    parser.add_argument(
        "--in-flight", type=int, default=6, help="requests running when a fault fires"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_checkpoint(build_model(ModelConfig(**CFG), seed=0), model)
        write_tokenizer(model, CFG["vocab_size"])
        solo = solo_run(model, args)

        def stop_rank(proc, port):
            os.kill(rank_pids(proc.pid)[1], signal.SIGSTOP)

        def kill_rank(proc, port):
            os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)

        phases = [
            ("bad requests + hostile clients", lambda proc, port: hostile(port, args.hostile)),
            ("rank 1 stopped (SIGSTOP)", stop_rank),
            ("rank 1 killed (SIGKILL)", kill_rank),
            ("SIGTERM mid-load", lambda proc, port: proc.send_signal(signal.SIGTERM)),
        ]
        rows = [phase(model, name, args, fault, solo) for name, fault in phases]
    print_rows(rows)
    return 1 if any(r["lost"] or r["hung"] or r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
