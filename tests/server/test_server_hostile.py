"""Issue 30 against a real one-process server over real sockets: one error shape everywhere,
bounded stop lists, hostile clients (trickled headers, stalled bodies, too many connections)
timed out and bounded, the API-key and token-id nits, and the signal that drains."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from moe_overlap import LLM
from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.detokenize import TextStream
from moe_overlap.server import app as app_module
from moe_overlap.server.run import listening_socket
from tests.server.test_server import (
    KEY,
    SERVE,
    Running,
    alive_after,
    descendants,
    served_model,
)

JSON = {"Content-Type": "application/json"}
LIMITS = dict(
    api_key=KEY,
    max_request_bytes=32 << 10,
    max_buffered_bytes=64 << 10,
    header_timeout=1.0,
    body_timeout=1.0,
    max_connections=24,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return served_model(tmp_path_factory, "hostile")


@pytest.fixture(scope="module")
def served(model_dir):
    run = Running(LLM(model_dir, max_num_seqs=4), **LIMITS)
    yield run
    run.stop()
    assert run.error is None


def post(run: Running, body: dict | bytes, path: str = "/v1/completions", auth: str = ""):
    conn = http.client.HTTPConnection("127.0.0.1", run.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request(
        "POST",
        path,
        data,
        {"Authorization": auth or f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    raw = resp.read()
    assert resp.getheader("content-type", "").startswith("application/json"), raw[:200]
    return resp.status, json.loads(raw)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\udc00"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),
        ("/v1/completions", json.dumps({"prompt": "hi", "stop": list("abcde")}).encode(), "stop"),
        ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x" * 257]}).encode(), "stop"),
        ("/v1/completions", b'{"prompt": [true, 5]}', "prompt"),
        ("/v1/completions", b'{"prompt": [5], "stop_token_ids": [true]}', "stop_token_ids"),
    ],
)
def test_bad_values_are_400s_naming_the_field(served, path, body, param):
    code, reply = post(served, body, path)
    assert code == 400 and reply["error"]["param"] == param, reply
    assert set(reply["error"]) == {"message", "type", "code", "param"}


def test_four_stop_strings_and_a_top_seed_are_served(served):
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["a", "b", "c", "d"], "seed": 2**64 - 1}
    assert post(served, body)[0] == 200


def test_an_unexpected_error_is_a_json_500_and_oversize_is_413(served, monkeypatch):
    def broken(*args):
        raise RuntimeError("injected")

    monkeypatch.setattr(app_module, "encode_prompt", broken)
    code, reply = post(served, {"prompt": "hi"})
    assert code == 500 and reply["error"]["code"] == "internal_error"
    assert "injected" in reply["error"]["message"]
    monkeypatch.undo()
    code, reply = post(served, {"prompt": "x" * (40 << 10)})
    assert code == 413 and "--max-request-bytes" in reply["error"]["message"]


def test_lowercase_bearer_is_accepted(served):
    assert post(served, {"prompt": "hi", "max_tokens": 1}, auth=f"bearer {KEY}")[0] == 200
    assert post(served, {"prompt": "hi"}, auth=f"bearer {KEY}x")[0] == 401


def test_stop_matching_searches_only_the_new_tail():
    class Text(str):
        starts: list[int] = []

        def find(self, sub, start=0, *rest):
            Text.starts.append(start)
            return str.find(self, sub, start, *rest)

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return Text("".join(chr(97 + i) for i in ids))

    stream = TextStream(Tok(), ["xyz", "ba"])
    for i in range(300):
        assert not stream.push(i % 20 + 2)  # c..v: never a stop string
        assert min(Text.starts[-2:]) >= len(stream.text) - 1 - 2  # the tail only
    assert not stream.push(1) and stream.push(0)  # "b" then "a": "ba" spans two tokens
    assert stream.stopped and stream.text.endswith("v") and "ba" not in stream.text


def raw_socket(run: Running) -> socket.socket:
    return socket.create_connection(("127.0.0.1", run.port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before it closed the connection (a reset counts as closed)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_trickled_headers_are_dropped_and_others_served(served):
    socks = [raw_socket(served) for _ in range(10)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    assert post(served, {"prompt": "hi", "max_tokens": 1})[0] == 200
    for s in socks:
        with s:
            s.sendall(b"X-Slow: 1\r\n")
            assert closed_within(s, 5.0) == b""  # closed by the server, nothing answered
    assert time.monotonic() - start < 4.0


def test_stalled_body_gets_408_and_the_body_budget_holds(served):
    gate = served.server.app.state.gate
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n"
        "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    )
    first = [raw_socket(served) for _ in range(2)]
    for s in first:  # 2 x 30 KiB received of the 64 KiB budget
        s.sendall(head.format(KEY, 31 << 10).encode() + b" " * (30 << 10))
    time.sleep(0.2)
    assert gate.buffered == 60 << 10  # what came, not what was declared
    third = raw_socket(served)
    third.sendall(head.format(KEY, 31 << 10).encode() + b" " * (8 << 10))
    answer = closed_within(third, 5.0)
    assert answer.startswith(b"HTTP/1.1 503") and b"server_busy" in answer
    for s in first:
        answer = closed_within(s, 5.0)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
        s.close()
    assert gate.buffered == 0
    assert post(served, {"prompt": "hi", "max_tokens": 1})[0] == 200


def test_connections_past_the_cap_get_a_json_503(served):
    idle = [raw_socket(served) for _ in range(LIMITS["max_connections"])]
    try:
        extra = raw_socket(served)
        answer = closed_within(extra, 5.0)
        assert answer.startswith(b"HTTP/1.1 503") and b'"code": "server_busy"' in answer
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert post(served, {"prompt": "hi", "max_tokens": 1})[0] == 200


def _serve(model_dir, port: int, *extra: str, group: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-c", SERVE, "serve", "--model", str(model_dir), "--port", str(port)]
    return subprocess.Popen(
        [*cmd, *extra], stderr=subprocess.PIPE, text=True, start_new_session=group
    )


def test_a_port_in_use_is_named_before_the_model_loads(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cli = [sys.executable, "-m", "moe_overlap.tools.cli", "serve", "--model", str(model_dir)]
        proc = subprocess.run(
            [*cli, "--port", str(port), "--ep", "2"], capture_output=True, text=True, timeout=120
        )
        err = proc.stderr
    assert proc.returncode == 2 and "serving" not in err and "KV cache" not in err
    assert f"--port {port}: address already in use; choose another --port (0: a free one)" in err


def test_a_bad_host_is_named_with_its_own_fix():
    with pytest.raises(ConfigError, match=r"--host 999\.1\.1\.1 --port 0: .*; give an address"):
        listening_socket("999.1.1.1", 0)
    with listening_socket("127.0.0.1", 0) as sock:
        assert sock.getsockname()[1] > 0


@pytest.mark.parametrize("group", [False, True])
def test_sigterm_drains_then_ends_streams_and_requests_in_openai_shape(model_dir, group):
    """At ep=2: the server then stops, and its two ranks and their fork server with it. On
    port 0, it names the port the system chose. ``group``: the SIGTERM reaches the ranks and
    the fork server too (``timeout``, ``kill -- -PGID``, systemd), which leave it to the server."""
    args = ("--shutdown-timeout", "0.3", "--max-num-seqs", "2", "--ep", "2")
    proc = _serve(model_dir, 0, *args, group=group)
    try:
        deadline = time.monotonic() + 60
        while "serving" not in (line := proc.stderr.readline()):
            assert line and time.monotonic() < deadline
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0
        rank_pids = descendants(proc.pid)
        assert len(rank_pids) == 3
        long = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        stream.request("POST", "/v1/completions", json.dumps({**long, "stream": True}), JSON)
        events = stream.getresponse()
        assert events.readline().startswith(b"data: {")  # the stream is under way
        whole = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        whole.request("POST", "/v1/completions", json.dumps(long), JSON)
        time.sleep(0.2)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        late.request("GET", "/v1/models")
        refused = late.getresponse()
        assert refused.status == 503 and refused.getheader("retry-after")
        assert json.loads(refused.read())["error"]["code"] == "shutting_down"
        lines = [ln for ln in events.read().decode().splitlines() if ln]
        assert lines[-1] == "data: [DONE]" and '"shutting_down"' in lines[-2]
        reply = whole.getresponse()
        assert reply.status == 503 and json.loads(reply.read())["error"]["code"] == "shutting_down"
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert "Traceback" not in proc.stderr.read()
        assert not alive_after(rank_pids, 5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_shutdown_completes_whatever_close_raises(model_dir, monkeypatch):
    llm = LLM(model_dir, max_num_seqs=2)
    run = Running(llm, shutdown_timeout=0.5)
    closed = llm.close

    def broken() -> None:
        closed()
        raise RuntimeError("the rank fork server is gone")

    monkeypatch.setattr(llm, "close", broken)
    start = time.monotonic()
    run.server.stop()  # what the first SIGTERM does
    run.thread.join(10)
    assert not run.thread.is_alive() and run.error is None
    assert time.monotonic() - start < 0.5 + 5
