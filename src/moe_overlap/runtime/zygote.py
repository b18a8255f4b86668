"""A fork server for rank processes: one interpreter imports torch and the rank code once, and
every rank is forked from it, so a rank starts in milliseconds instead of importing torch anew.

The driver starts one server per process (``python -m moe_overlap.runtime.zygote FD``) and keeps
it for the rest of its life, so later engines start their ranks from it too. Each rank is a
child of the server, not of the driver: ``ForkedProcess`` gives the driver what it used from
``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``kill``), with exit codes reaped by the
server. The server never runs a torch op, so no thread pool exists to be broken by ``fork``;
it exits when the driver closes its socket (the driver exited), leaving running ranks to notice
their own driver's socket closing. If it dies first, the driver watches its pidfd as a rank's and
stops the engine naming it (``Zygote.death``); its ranks, now init's children, still stop when
told, with their exit codes unknown (``EXIT_UNKNOWN``).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

_MAX_MESSAGE = 1 << 20
EXIT_UNKNOWN = -1000  # a rank that ended after its fork server died: init reaped it, not us


class ZygoteError(RuntimeError):
    """The fork server could not start a rank."""


class ForkServerDied(ZygoteError):
    """The fork server is gone: no rank can be started, and no rank's exit code read."""


class ForkedProcess:
    """A rank forked by the server, with the part of ``subprocess.Popen`` the driver uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.pidfd = os.pidfd_open(pid)  # readable once the process has exited
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(0.0, raise_timeout=False)

    def wait(self, timeout: float | None = None, raise_timeout: bool = True) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], timeout)[0]:
            for _ in range(100):  # exited; waitable at once, or within a moment
                try:
                    self.returncode = self.zygote.reap(self.pid)
                except ForkServerDied:  # it ended all the same; its code went with the server
                    self.returncode = EXIT_UNKNOWN
                if self.returncode is not None:
                    break
                time.sleep(0.01)
        if self.returncode is None and raise_timeout:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:  # once reaped, the pid may belong to someone else
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        os.close(self.pidfd)


class Zygote:
    """The driver's handle on its fork server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_overlap.runtime.zygote", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,  # so no received descriptor lands on 0, 1 or 2
            # c10d warns about every unresolvable hostname inside a network namespace
            env={"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ},
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.asked = 0  # messages sent; each reply names the one it answers
        self.pidfd = os.pidfd_open(self.proc.pid)  # readable once the server has exited

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self) -> str | None:
        """Why this server can no longer start or reap ranks, or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"the rank fork server (pid {self.proc.pid}) died (exit code {code})"

    def spawn(self, conn_fd: int) -> ForkedProcess:
        """Fork a rank that serves the driver over ``conn_fd`` (``worker.serve_fd``), in this
        process's current directory, environment and standard streams."""
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR", **os.environ}
        with open(os.devnull, "r+b") as null:  # ranks read no stdin; and for a closed stream
            out = [fd if _is_open(fd) else null.fileno() for fd in (1, 2)]
            reply = self._ask(("spawn", env, os.getcwd()), [conn_fd, null.fileno(), *out])
        return ForkedProcess(self, reply)

    def reap(self, pid: int) -> int | None:
        return self._ask(("reap", pid))

    def _ask(self, message: tuple, fds: list[int] | None = None):
        """The server's answer to ``message``. An earlier ask interrupted before its reply was
        read (Ctrl-C while an engine started) left that reply queued: it is read and dropped
        here, never taken for this one's (a pid as an exit code, an exit code as a pid)."""
        with self.lock:
            self.asked += 1
            try:
                socket.send_fds(self.sock, [pickle.dumps((self.asked, *message))], fds or [])
                answered, kind, value = None, "", None
                while answered != self.asked:
                    data = self.sock.recv(_MAX_MESSAGE)
                    if not data:
                        code = self.proc.poll()
                        raise ForkServerDied(f"the rank fork server exited (code {code})")
                    answered, kind, value = pickle.loads(data)
            except OSError as exc:
                raise ForkServerDied(f"the rank fork server is gone: {exc}") from exc
        if kind == "error":
            raise ZygoteError(value)
        return value


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_lock = threading.Lock()
_zygote: tuple[int, Zygote] | None = None  # (owner pid, server): a forked driver starts its own


def zygote() -> Zygote:
    """This process's fork server, started on first use and again if it died."""
    global _zygote
    with _lock:
        if _zygote is None or _zygote[0] != os.getpid() or not _zygote[1].alive():
            _zygote = (os.getpid(), Zygote())
        return _zygote[1]


# ---- the server's side ----


def _serve(sock: socket.socket, serve_fd: Callable[[int], None]) -> None:
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
        except OSError:
            return
        if not data:
            return  # the driver exited
        asked, kind, *args = pickle.loads(data)
        try:
            reply: tuple[int, str, object] = (
                asked,
                "ok",
                _fork(sock, serve_fd, fds, *args) if kind == "spawn" else _reap(*args),
            )
        except Exception as exc:  # tell the driver; the server keeps serving
            reply = (asked, "error", f"{type(exc).__name__}: {exc}")
        finally:
            for fd in fds:
                os.close(fd)
        sock.send(pickle.dumps(reply))


def _fork(
    sock: socket.socket, serve_fd: Callable[[int], None], fds: list[int], env: dict, cwd: str
) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        sock.close()
        for target, fd in enumerate(fds[1:]):  # stdin (null), the driver's stdout and stderr
            os.dup2(fd, target)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        serve_fd(os.dup(fds[0]))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pid: int) -> int | None:
    done, status = os.waitpid(pid, os.WNOHANG)
    return os.waitstatus_to_exitcode(status) if done else None


def main() -> None:
    # Ctrl-C, and a SIGTERM sent to the whole process group, are for the driver to handle
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # imported here once, so that no forked rank imports torch and the rank code again (and
    # not at the module's top: the driver imports this module for ``zygote()`` alone, which
    # the command line calls before its own import of torch)
    import moe_overlap.runtime.worker as worker

    _serve(socket.socket(fileno=int(sys.argv[1])), worker.serve_fd)


if __name__ == "__main__":
    main()
