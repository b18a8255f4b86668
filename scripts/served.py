"""A tiny model served by ``moe-overlap serve`` for the scripts that drive it with a real client
(``lm_eval_check.py``, ``sglang_bench_check.py``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_tiny_model(out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "moe_overlap.tools.cli", "make-model", "--hf-config",
         str(ROOT / "configs/qwen3-moe-tiny.json"), "--out", str(out), "--seed", "0"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: Path, port: int) -> subprocess.Popen:
    """``serve --ep 2`` with two-batch overlap, once ``/health`` answers."""
    cmd = [sys.executable, "-m", "moe_overlap.tools.cli", "serve", "--model", str(model),
           "--ep", "2", "--enable-two-batch-overlap", "--port", str(port),
           "--served-model-name", "tiny", "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}") from None
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy in 120 s")
