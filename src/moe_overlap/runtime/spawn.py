"""Start expert-parallel ranks on this machine and drive them, step by step, from the caller.

The caller's process owns the scheduler; each rank is a child process holding its expert shard
and attention-DP share of the sequences. Every step the driver sends each rank its ForwardBatch
through a pipe and collects its logits. A rank that raises or dies stops the whole engine within
the collective timeout, with an error naming it, and no child is left behind.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.step import StepReply, StepRequest
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.distributed.netns import NetnsLink
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.rank import RankSpec, gather_replies
from moe_overlap.runtime.rank_process import RankProcess
from moe_overlap.runtime.zygote import EXIT_UNKNOWN

_GRACE_S = 10.0  # beyond the collective timeout, for the failing rank to report
_DEATH_GRACE_S = 1.0  # after a rank's error, for a peer's death (its cause) to show
_STOPPED = ("T", "t")  # /proc states of a process stopped by a signal or a tracer


class RankFailure(RuntimeError):
    """A rank raised or died; the engine has been stopped."""


class RankRefusal(RankFailure, ValueError):
    """A rank refused its settings or checkpoint (``ConfigError``, ``CheckpointError``): the
    message names the fault and its fix, so it comes without the rank's traceback."""


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, so no message is half sent or read and lost."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield  # only the main thread sees signals; SIG_IGN and SIG_DFL need no care
        return
    caught: list[tuple] = []
    signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])


class SpawnedExecutor(Executor):
    moves_experts = True

    def __init__(
        self,
        spec: EngineSpec,
        link: LinkSpec,
        timeout_s: float = 60.0,
        threads_per_rank: int = 1,
    ):
        world = spec.parallel.world_size
        self.num_ranks, self.num_dp, self.timeout_s = world, spec.parallel.attn_dp, timeout_s
        self.parallel = spec.parallel
        self.link_spec = link
        self.netns: NetnsLink | None = None
        self.store_dir: str | None = None
        self.procs: list[RankProcess] = []
        self.conns: list[Connection] = []
        self.closed = False
        self._unread: set[int] = set()  # ranks whose reply to the last step is not read yet
        try:
            self._start(spec, threads_per_rank)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: EngineSpec, threads: int) -> None:
        if self.link_spec.kind == "netns":
            self.netns = NetnsLink(self.num_ranks, self.link_spec.spec.split(":", 1)[1])
            self.netns.__enter__()
            init = f"tcp://{self.netns.rank_addr(0)}:29500"
        else:  # a file store opens no socket; gloo binds to loopback (ifname "lo" below)
            self.store_dir = tempfile.mkdtemp(prefix="moe-overlap-store-")
            init = f"file://{self.store_dir}/store"
        for r in range(self.num_ranks):
            rank = RankSpec(
                r,
                self.num_ranks,
                init,
                self.timeout_s,
                self.link_spec,
                self.netns.netns_name(r) if self.netns else None,
                self.netns.ifname if self.netns else "lo",
                threads,
            )
            self.procs.append(RankProcess(r, spec, rank))
        self.conns = [p.conn for p in self.procs]
        self._collect(list(range(self.num_ranks)), startup=True)

    def step(self, request: StepRequest) -> StepReply:
        replies = self._request([("step", request)] * self.num_ranks)
        return gather_replies(self.parallel, replies)

    def probe(self, num_bytes: int, repeats: int = 5, p2p: bool | None = None) -> list[list[float]]:
        return self._request([("probe", num_bytes, repeats, p2p)] * self.num_ranks)

    def expert_load(self, action: str) -> list[dict[int, list[int]] | None]:
        return self._request([("experts", action)] * self.num_ranks)

    def rebalance_experts(self, layers_per_chunk: int) -> list:
        return self._request([("eplb", layers_per_chunk)] * self.num_ranks)

    def restart_expert_window(self) -> None:
        self._request([("eplb-window",)] * self.num_ranks)

    def _request(self, messages: list[tuple]) -> list:
        """Send each rank its message and collect every reply. A call interrupted while
        waiting (Ctrl-C) leaves replies unread: the next call reads and drops them first, so
        no reply is ever taken for another step's. Ctrl-C is held while a message is sent or
        read, so every rank gets the step or none does, and no reply is lost half read."""
        if self.closed:
            raise RankFailure("the engine was stopped (closed, or a rank failed earlier)")
        if self._unread:
            self._collect(sorted(self._unread))  # the interrupted step's replies
        with _sigint_held():
            sent, pickled = 0, {}  # a message every rank gets is pickled once, not per rank
            try:
                for conn, msg in zip(self.conns, messages, strict=True):
                    if id(msg) not in pickled:
                        pickled[id(msg)] = ForkingPickler.dumps(msg)
                    conn.send_bytes(pickled[id(msg)])
                    sent += 1
            except OSError:  # its pipe is gone: the rank died while the engine was idle
                self._fail(self._death(sent))
            except BaseException:
                if sent:  # the ranks that got it would wait for the others forever
                    self.close()
                raise
            self._unread = set(range(self.num_ranks))
        return self._collect(list(range(self.num_ranks)))

    def _collect(self, ranks: list[int], startup: bool = False) -> list:
        """The reply of each of ``ranks``, or a RankFailure naming the rank that failed first."""
        replies: dict[int, object] = {}
        limit = self.timeout_s + _GRACE_S + (120.0 if startup else 0.0)
        deadline = time.monotonic() + limit
        while len(replies) < len(ranks):
            pending = [r for r in ranks if r not in replies]
            ready = wait(
                [self.conns[r] for r in pending] + [self.procs[r].pidfd for r in pending],
                timeout=max(0.0, deadline - time.monotonic()),
            )
            if not ready:
                self._fail(
                    f"ranks {pending} sent nothing for {limit:.0f} s "
                    f"(collective timeout {self.timeout_s:.0f} s)"
                )
            for r in pending:
                if self.conns[r] in ready or self.conns[r].poll():
                    try:
                        with _sigint_held():
                            msg = self.conns[r].recv()
                            self._unread.discard(r)
                    except (EOFError, OSError):
                        self._fail(self._death(r))
                    if msg[0] == "error":
                        stuck = self._stuck(msg, [p for p in pending if p != r])
                        trace = f"\n{msg[3]}" if msg[3] else ""
                        why = f"{stuck}rank {msg[1]} raised {msg[2]}{trace}"
                        self._fail(why, refusal=not msg[3])
                    replies[r] = msg[1]
                elif self.procs[r].pidfd in ready:
                    self._fail(self._death(r))
        return [replies[r] for r in ranks]

    def health(self) -> str | None:
        if self.closed:
            return "the ranks were stopped"
        for p in self.procs:  # its own failure, named before any rank's that follows from it
            died = p.proc.zygote.death()
            if died:
                return f"{died}; the ranks can no longer be started or their exits read"
        for r, p in enumerate(self.procs):
            if p.ended():
                code = p.proc.returncode  # None until the driving thread reaps it
                return f"rank {r} died" + (f" (exit code {code})" if code is not None else "")
            if p.state() in _STOPPED:
                return f"rank {r} is stopped (process state {p.state()}) and cannot answer"
        return None

    def sentinels(self) -> list[int]:
        """The ranks' pidfds and their fork server's: readable once one of them has ended."""
        if self.closed:
            return []
        servers = {p.proc.zygote.pidfd for p in self.procs}
        return [p.pidfd for p in self.procs] + sorted(servers)

    def _stuck(self, msg: tuple, silent: list[int]) -> str:
        """After a rank's collective timed out: name the rank that stopped answering (a
        stopped process, else one that stays silent while its peers report), and kill it so
        that closing does not wait for it. "" when the error was something else."""
        if "CollectiveTimeout" not in msg[2]:
            return ""
        stopped = [r for r, p in enumerate(self.procs) if p.state() in _STOPPED]
        if not stopped:
            deadline = time.monotonic() + _DEATH_GRACE_S
            while silent and time.monotonic() < deadline:
                ready = wait([self.conns[r] for r in silent], timeout=0.05)
                silent = [r for r in silent if self.conns[r] not in ready]
        blamed = stopped or silent
        for r in blamed:
            self.procs[r].proc.kill()
        if not blamed:
            return ""
        how = "is stopped" if stopped else "sent nothing"
        return f"rank {blamed[0]} stopped answering ({how}; killed); "

    def _death(self, r: int) -> str:
        code = self.procs[r].exitcode(1.0)
        shown = "unknown: the fork server died before it" if code == EXIT_UNKNOWN else code
        return f"rank {r} died (exit code {shown})"

    def _fail(self, why: str, refusal: bool = False) -> None:
        # a rank that died is the cause; the others' collective errors are its echo, and may
        # arrive while the killed process is still being torn down: look for a second
        deadline = time.monotonic() + (0.0 if "stopped answering" in why else _DEATH_GRACE_S)
        while True:
            dead = [r for r, p in enumerate(self.procs) if p.exitcode() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if dead and "stopped answering" not in why and not why.startswith(f"rank {dead[0]} "):
            why = f"{self._death(dead[0])}; then {why}"
        self.close()
        raise (RankRefusal if refusal else RankFailure)(why)

    def close(self) -> None:
        """Stop every rank (politely, then by force) and remove the link."""
        if self.closed:
            return
        self.closed = True
        with _sigint_held():  # a second Ctrl-C must not leave ranks or namespaces behind
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.send(("stop",))
            deadline = time.monotonic() + 5.0
            for p in self.procs:
                p.stop(max(0.0, deadline - time.monotonic()))
            if self.netns is not None:
                self.netns.close()
            if self.store_dir is not None:
                shutil.rmtree(self.store_dir, ignore_errors=True)
