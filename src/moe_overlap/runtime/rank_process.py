"""One rank process as the driver sees it: its pipe, its pidfd and its /proc state."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.runtime.rank import RankSpec


class RankProcess:
    """A rank in a fresh interpreter (``python -m moe_overlap.runtime.worker``).

    A subprocess rather than multiprocessing's spawn: that would re-run the caller's
    ``__main__``, which breaks any script without an ``if __name__ == "__main__"`` guard.
    """

    def __init__(self, rank: int, spec: EngineSpec, rank_spec: RankSpec):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_overlap.runtime.worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            # c10d warns about every unresolvable hostname inside a network namespace
            env={"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ},
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.conn.send_bytes(pickle.dumps((spec, rank_spec)))

    def exitcode(self, timeout: float = 0.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

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
        os.close(self.pidfd)
