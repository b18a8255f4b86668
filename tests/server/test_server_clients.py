"""Issue 43's cheap-client probes against a real server over real sockets: declared but unsent
bodies hold none of the body budget, an oversized body's 413 reaches Python's own HTTP client,
and one address's idle connections leave room for another's."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from moe_overlap import LLM
from tests.server.test_server import KEY, Running, served_model

PER_CLIENT = 300


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    llm = LLM(served_model(tmp_path_factory, "clients"), max_num_seqs=4)
    run = Running(llm, api_key=KEY, max_connections_per_client=PER_CLIENT)
    yield run
    run.stop()
    assert run.error is None


def connect(run: Running, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", run.port), timeout=10, source_address=(source, 0))


def completion(run: Running, source: str = "127.0.0.1", data: bytes | None = None):
    """A POST from ``source`` over a raw socket: (status, JSON reply)."""
    data = data or json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    with connect(run, source) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (KEY.encode(), len(data), data)
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_declared_but_unsent_bodies_do_not_block_a_post(served):
    gate = served.server.app.state.gate
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
        b"Content-Length: %d\r\n\r\n" % (KEY.encode(), 1 << 20)
    )
    slow = [connect(served, "127.0.0.1") for _ in range(256)]
    try:
        for s in slow:
            s.sendall(head + b" " * 1024)
        deadline = time.monotonic() + 5
        while gate.buffered < 256 << 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate.buffered == 256 << 10  # the bytes that came, not the 256 MiB declared
        start = time.monotonic()
        status, reply = completion(served)
        assert status == 200, reply
        assert time.monotonic() - start < 5
    finally:
        for s in slow:
            s.close()


def test_an_oversized_body_gets_a_413_urllib_can_read(served):
    big = json.dumps(
        {"prompt": "x" * (12 << 20)}
    ).encode()  # > the 1 MiB default and a socket buffer
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.port}/v1/completions",
        data=big,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 413
    error = json.loads(caught.value.read())["error"]
    assert error["code"] == "too_large" and "--max-request-bytes" in error["message"]
    assert completion(served)[0] == 200


def test_one_address_idle_connections_leave_room_for_another(served):
    start = time.monotonic()
    idle = [connect(served, "127.0.0.2") for _ in range(1000)]
    try:
        refused = idle[-1]  # past the per-client cap: answered 503 and closed at once
        refused.settimeout(5)
        answer = refused.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"this client has too many" in answer
        status, reply = completion(served, "127.0.0.1")
        assert status == 200, reply
    finally:
        for s in idle:
            s.close()
    assert time.monotonic() - start < 10
    deadline = time.monotonic() + 5
    while not served_from(served, "127.0.0.2"):  # its closed sockets are released
        assert time.monotonic() < deadline
        time.sleep(0.05)


def served_from(run: Running, source: str) -> bool:
    try:
        return completion(run, source)[0] == 200
    except ConnectionResetError:  # refused at connection, before the request was read
        return False


def test_an_oversized_chunked_body_and_an_expect_continue_get_their_413(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    pieces = (b" " * (64 << 10) for _ in range(192))  # 12 MiB, no Content-Length
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", pieces, headers, encode_chunked=True)
    reply = conn.getresponse()
    assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "too_large"
    with connect(served, "127.0.0.1") as sock:  # asked first: refused without the body
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (KEY.encode(), 2 << 20)
        )
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"100 Continue" not in answer
