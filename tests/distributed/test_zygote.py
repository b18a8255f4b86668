"""The rank fork server: engines fork their ranks from one server per driver process, which
outlives an engine and is restarted if it dies."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.runtime.worker import serve_fd
from moe_overlap.runtime.zygote import Zygote, zygote
from tests.helpers import TINY

PARAMS = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_engines_fork_their_ranks_from_one_server_that_is_restarted_if_it_dies():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    server = zygote()
    with LLM(config=cfg, ep=2, seed=0) as llm:
        first = llm.generate([[1, 2, 3]], PARAMS)[0].token_ids
        ranks = [p.proc.pid for p in llm.executor.procs]
        assert [_parent(pid) for pid in ranks] == [server.proc.pid] * 2
        assert Path(f"/proc/{ranks[0]}/cwd").resolve() == Path.cwd().resolve()
    assert zygote() is server and server.alive()  # kept for the next engine
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks)  # exited and reaped
    server.proc.kill()
    server.proc.wait(10)
    with LLM(config=cfg, ep=2, seed=0) as llm:
        assert llm.generate([[1, 2, 3]], PARAMS)[0].token_ids == first
        assert _parent(llm.executor.procs[0].proc.pid) == zygote().proc.pid != server.proc.pid


class _InterruptedOnce:
    """The server's socket, with its first read interrupted (Ctrl-C before the reply came)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.interrupted = sock, False

    def recv(self, size: int) -> bytes:
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return self.sock.recv(size)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_a_reply_an_interrupted_ask_left_unread_is_not_taken_for_the_next_ones():
    """Ctrl-C while an engine started its ranks left the server's reply queued, and the next
    ask read it: a pid came back as a rank's exit code ("rank 0 died (exit code <pid>)")."""
    server = Zygote()
    ours, theirs = socket.socketpair()
    rank = server.spawn(theirs.fileno())  # waits for its engine's spec on ``ours``
    theirs.close()
    real, server.sock = server.sock, _InterruptedOnce(server.sock)  # type: ignore[assignment]
    try:
        with pytest.raises(KeyboardInterrupt):
            server.reap(1)  # not its child: the reply, never read, is an error
        assert server.reap(rank.pid) is None  # its own reply: still running
    finally:
        server.sock = real
        rank.kill()
        assert rank.wait(10) == -9
        rank.close()
        ours.close()
        real.close()
        server.proc.wait(10)


def test_a_rank_whose_driver_left_before_sending_its_specs_exits_quietly():
    """Ctrl-C while an engine starts: the driver goes before a forked rank reads its specs;
    the rank ends without an EOFError traceback on the shared stderr."""
    ours, theirs = socket.socketpair()
    ours.close()
    serve_fd(theirs.detach())  # returns: nothing raised
