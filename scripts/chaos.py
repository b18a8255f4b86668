"""Chaos run for the server (issue 30): a load of mixed requests while faults are injected, one
phase per fault, each against a fresh ``moe-overlap serve --ep 2`` of a tiny model on CPU.

Every request ends in one of: answered (a whole answer, or a stream ending in [DONE]), errored
with a reason (an OpenAI error body or stream error event, then [DONE]), lost (no answer, an
answer not in the OpenAI shape, or a stream cut without [DONE]) or hung (nothing within
--client-timeout); "refused" counts connections tried after the server exited (a dead rank
stops it). Lost and hung must be 0. Hostile clients (trickled headers, stalled bodies,
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


def ask(port: int, body: bytes, path: str, timeout: float) -> str:
    """One request's outcome: "answered", "error:<code>", "lost:<why>" or "hung"."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    except TimeoutError:
        return "hung"
    except ConnectionRefusedError:  # the server had already exited (a dead rank stops it)
        return "refused"
    except (OSError, http.client.HTTPException) as exc:
        return f"lost:{type(exc).__name__}"
    if resp.getheader("content-type", "").startswith("text/event-stream"):
        lines = [ln for ln in raw.decode().splitlines() if ln]
        if not lines or lines[-1] != "data: [DONE]":
            return "lost:stream cut"
        errors = [json.loads(ln[6:])["error"] for ln in lines[:-1] if '"error"' in ln[:20]]
        return f"error:{errors[0]['code']}" if errors else "answered"
    try:
        reply = json.loads(raw)
    except ValueError:
        return "lost:not json"
    if resp.status == 200 and reply.get("choices"):
        return "answered"
    if "error" in reply and reply["error"].get("message"):
        return f"error:{reply['error']['code']}"
    return "lost:bad shape"


def mixed(port: int, count: int, timeout: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    jobs = []
    for i in range(count):
        if i % 4 == 3:
            jobs.append(
                (
                    BAD[i // 4 % len(BAD)],
                    "/v1/chat/completions"
                    if b"messages" in BAD[i // 4 % len(BAD)]
                    else "/v1/completions",
                )
            )
            continue
        body = {"prompt": f"Question {i}: where?", "max_tokens": rng.randint(4, 64)}
        body |= {"stream": rng.random() < 0.5, "temperature": rng.choice([0, 0.7])}
        jobs.append((json.dumps(body).encode(), "/v1/completions"))
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda j: ask(port, j[0], j[1], timeout), jobs))


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


def phase(model: Path, name: str, args: argparse.Namespace, fault) -> dict:
    port = free_port()
    proc = serve(model, port)
    try:
        mixed(port, 8, args.client_timeout, 0)  # warm up before the baseline
        before = rss_mib(proc.pid)
        result: dict = {}
        load = threading.Thread(
            target=lambda: result.update(out=mixed(port, args.requests, args.client_timeout, 1))
        )
        load.start()
        time.sleep(1.0)
        hostile_seen = fault(proc, port)
        load.join()
        time.sleep(2.0)
        after = rss_mib(proc.pid) if proc.poll() is None else None
    finally:
        try:
            proc.wait(0 if name.startswith("bad") else 15)  # a dead rank stops the server
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        proc.reader.join(15)  # type: ignore[attr-defined]
    outcomes = Counter(o.split(":")[0] for o in result["out"])
    reasons = Counter(o.split(":", 1)[1] for o in result["out"] if o.startswith("error:"))
    log = getattr(proc, "log", "(stderr still open: not read)")
    return {
        "phase": name,
        "sent": len(result["out"]),
        **{k: outcomes.get(k, 0) for k in ("answered", "error", "lost", "hung", "refused")},
        "reasons": dict(reasons),
        "lost_why": [o for o in result["out"] if o.startswith("lost")],
        "hostile": dict(hostile_seen or {}),
        "rss": (before, after),
        "exit": code,
        "tracebacks": log.count("Traceback"),
        "last": log.strip().splitlines()[-1][:150] if log.strip() else "",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40, help="mixed requests per phase")
    parser.add_argument("--hostile", type=int, default=150, help="hostile connections")
    parser.add_argument("--client-timeout", type=float, default=60.0, help="seconds = hung")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        save_checkpoint(build_model(ModelConfig(**CFG), seed=0), model)
        write_tokenizer(model, CFG["vocab_size"])

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
        rows = [phase(model, name, args, fault) for name, fault in phases]
    head = f"{'phase':32} {'sent':>4} {'answered':>8} {'errored':>7} {'lost':>4} {'hung':>4}"
    print(head + " refused  RSS MiB before->after  exit  tracebacks")
    for r in rows:
        rss = f"{r['rss'][0]:.0f}->" + (f"{r['rss'][1]:.0f}" if r["rss"][1] else "(exited)")
        print(
            f"{r['phase']:32} {r['sent']:>4} {r['answered']:>8} {r['error']:>7} {r['lost']:>4} "
            f"{r['hung']:>4} {r['refused']:>7}  {rss:>21}  {r['exit']:>4}  {r['tracebacks']:>10}"
        )
        print(f"    reasons: {r['reasons']}")
        if r["hostile"]:
            print(f"    hostile connections: {r['hostile']}")
        print(f"    server's last words: {r['last']}")
        if r["lost_why"]:
            print(f"    lost: {Counter(r['lost_why'])}")
    return 1 if any(r["lost"] or r["hung"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
