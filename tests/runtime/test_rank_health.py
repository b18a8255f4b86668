"""Issue 30 at --ep 2: /health sees a stopped or dead rank at once, a stuck rank is named (not
its peer that timed out waiting) and clients hear it before the engine closes, and the ranks
listen on loopback only."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moe_overlap import LLM
from tests.server.test_server import Running, _free_port, _metrics, served_model

TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory, "ranks")


def serve_ep2(model_dir) -> Running:
    return Running(LLM(model_dir, ep=2, max_num_seqs=2, timeout_s=TIMEOUT_S))


def health_within(run: Running, seconds: float, status: int) -> tuple[float, dict]:
    start = time.monotonic()
    while True:
        code, reply = run.raw("GET", "/health")
        if code == status or time.monotonic() - start > seconds:
            return time.monotonic() - start, (code, reply)
        time.sleep(0.05)


def listening(pid: int) -> list[str]:
    """The local addresses of the TCP sockets process ``pid`` listens on or talks from."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = (
            os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        )
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    found.append(cols[1].split(":")[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def test_stopped_rank_is_seen_by_health_and_ranks_use_loopback_only(model_dir):
    run = serve_ep2(model_dir)
    try:
        executor = run.server.engine.llm.executor
        assert run.raw("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[0] == 200
        for p in executor.procs:
            addrs = listening(p.proc.pid)
            assert addrs and set(addrs) <= LOOPBACK, addrs
        os.kill(executor.procs[1].proc.pid, signal.SIGSTOP)
        took, (code, reply) = health_within(run, 1.0, 503)
        assert code == 503 and "rank 1 is stopped" in reply["error"]["message"] and took < 1.0
        assert _metrics(run)["moe_overlap_ranks_healthy"] == 0  # the gauge sees it too
        start = time.monotonic()  # a new request is refused at once, not held to --timeout
        code, reply = run.raw("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert code == 503 and reply["error"]["code"] == "rank_unhealthy", reply
        assert "rank 1 is stopped" in reply["error"]["message"]
        assert time.monotonic() - start < 1.0
        os.kill(executor.procs[1].proc.pid, signal.SIGCONT)
        assert health_within(run, 1.0, 200)[1][0] == 200
        assert run.raw("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')[0] == 200
        executor.procs[1].proc.kill()  # idle: no request will notice it
        took, (code, reply) = health_within(run, 1.0, 503)
        assert code == 503 and "rank 1 died" in reply["error"]["message"] and took < 1.0
        run.thread.join(10)
        assert not run.thread.is_alive() and "rank 1 died" in str(run.error)
    finally:
        run.stop()


def test_stuck_rank_is_named_and_clients_hear_before_close(model_dir):
    run = serve_ep2(model_dir)
    try:
        executor = run.server.engine.llm.executor
        conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=60)
        body = {"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        events = conn.getresponse()
        assert events.readline().startswith(b"data: {")
        os.kill(executor.procs[1].proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        lines = [ln for ln in events.read().decode().splitlines() if ln]
        heard = time.monotonic() - stopped
        error = json.loads(lines[-2][len("data: ") :])["error"]
        assert "rank 1 stopped answering" in error["message"], error
        assert heard < TIMEOUT_S + 2.0, heard  # the collective timeout, not close's 5 s more
        assert lines[-1] == "data: [DONE]"
        run.thread.join(15)
        assert all(p.proc.poll() is not None for p in executor.procs)
    finally:
        for p in run.server.engine.llm.executor.procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
        run.stop()


def test_killed_fork_server_is_named_and_sigterm_still_exits(model_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "moe_overlap.tools.cli", "serve", "--model", str(model_dir)]
    extra = ["--port", str(port), "--ep", "2", "--shutdown-timeout", "1"]
    proc = subprocess.Popen([*cmd, *extra], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while "serving" not in (line := proc.stderr.readline()):
            assert line and time.monotonic() < deadline
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        servers = [int(p) for p in children.stdout.split() if b"runtime.zygote" in _cmdline(p)]
        assert len(servers) == 1  # the ranks are its children, not the server's
        ranks = subprocess.run(["pgrep", "-P", str(servers[0])], capture_output=True, text=True)
        assert len(ranks.stdout.split()) == 2
        os.kill(servers[0], signal.SIGKILL)
        time.sleep(0.3)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        reply = conn.getresponse()
        assert reply.status == 503
        assert "rank fork server" in json.loads(reply.read())["error"]["message"]
        killed = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(1 + 5) in (1, 128 + signal.SIGTERM)
        assert time.monotonic() - killed < 1 + 5
        err = proc.stderr.read()
        assert "rank fork server" in err and "died" in err
        assert "Traceback" not in err and "rank 0 died" not in err and "rank 1 died" not in err
        for pid in map(int, ranks.stdout.split()):  # stopped all the same (init reaps them)
            assert _state(pid) in ("", "Z"), pid
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
