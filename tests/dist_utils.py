"""Run a function on N local ranks in separate processes and collect what each returns.

    def worker(rank, world_size, port, scale):   # module level: each rank process imports it
        init_gloo(rank, world_size, port)
        return rank * scale

    assert run_workers(worker, 2, 10) == [0, 10]

A worker's exception is re-raised in the test as ``WorkerError`` with the worker's traceback;
a worker that hangs or dies fails the test after ``timeout`` seconds and every straggler is
killed, so a broken collective never blocks the test run.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# A fresh interpreter per rank, like spawn, but forked from a server that imported torch once:
# a rank starts in ~0.1 s instead of 2-5 s of `import torch` on two busy cores.
START_METHOD = "forkserver"


class WorkerError(RuntimeError):
    """One or more ranks raised, did not report, or died."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 30.0) -> None:
    """Join the default gloo process group on 127.0.0.1:``port``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args, results) -> None:
    torch.set_num_threads(1)  # two cores shared by every rank
    try:
        # plain pickle copies tensors by value; the queue's default would use shared memory
        results.put((rank, True, pickle.dumps(fn(rank, world_size, port, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, port, *args)`` on ``world_size`` fresh processes.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); ``fn`` initialises
    ``torch.distributed`` itself (``init_gloo`` does it), the process group is destroyed after it
    returns. Returns each rank's result in rank order, or raises ``WorkerError``.
    """
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed"])  # used when the server starts
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    dead_since: float | None = None
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, payload = results.get(timeout=0.1)
                got[rank] = (ok, payload)
                if not ok:  # the others are likely stuck in a collective with this rank
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            except queue.Empty:
                pass
            silent = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
            if silent and dead_since is None:
                dead_since = time.monotonic()
            if silent and time.monotonic() - dead_since > 2.0:  # grace for a late queue flush
                break
    finally:
        _stop(procs, max(0.0, deadline - time.monotonic()))
    return _collect(procs, got, world_size, timeout)


def _stop(procs: list[mp.Process], grace: float) -> None:
    """Join every process, then terminate and kill whatever is left."""
    end = time.monotonic() + min(grace, 10.0)
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _collect(procs: list[mp.Process], got: dict, world_size: int, timeout: float) -> list[Any]:
    errors = [f"rank {r} raised:\n{got[r][1]}" for r in sorted(got) if not got[r][0]]
    for r in range(world_size):
        if r not in got:
            errors.append(
                f"rank {r} did not report (exit code {procs[r].exitcode}, timeout {timeout:g} s)"
            )
    if errors:
        raise WorkerError("\n".join(errors))
    return [pickle.loads(got[r][1]) for r in range(world_size)]
