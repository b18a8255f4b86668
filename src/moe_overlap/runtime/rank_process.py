"""One rank process as the driver sees it: its pipe, its pidfd and its /proc state."""

from __future__ import annotations

import pickle
import select
import socket
import subprocess
from multiprocessing.connection import Connection

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.runtime.rank import RankSpec
from moe_overlap.runtime.zygote import zygote


class RankProcess:
    """A rank forked from this process's fork server (``zygote.py``), which imported torch and
    the rank code once. Not multiprocessing's spawn: that would re-run the caller's
    ``__main__``, which breaks any script without an ``if __name__ == "__main__"`` guard.
    """

    def __init__(self, rank: int, spec: EngineSpec, rank_spec: RankSpec):
        ours, theirs = socket.socketpair()
        try:
            self.proc = zygote().spawn(theirs.fileno())
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.pidfd = self.proc.pidfd
        self.conn.send_bytes(pickle.dumps((spec, rank_spec)))

    def exitcode(self, timeout: float = 0.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def ended(self) -> bool:
        """Whether the process has exited, without reaping it: the thread that drives the
        ranks reaps, and a second reaper of the same pid would race it."""
        return bool(select.select([self.pidfd], [], [], 0)[0])

    def state(self) -> str:
        """The process's state letter from /proc ("R", "S", "T" stopped, ...; "" if gone)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return ""

    def stop(self, grace: float) -> None:
        if self.exitcode(grace) is None:
            self.proc.kill()
            self.proc.wait(5.0)
        self.conn.close()
        self.proc.close()
