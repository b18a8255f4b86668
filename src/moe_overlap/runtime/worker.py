"""The body of one spawned rank process, forked by the fork server (``zygote.py``) or run as
``python -m moe_overlap.runtime.worker FD``.

It joins the group, builds its shard, and serves the driver's messages over the socket FD:
``("step", StepRequest)``, ``("probe", ...)`` and ``("stop",)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import CheckpointError, ConfigError
from moe_overlap.distributed.comm import CollectiveAborted, CollectiveTimeout
from moe_overlap.distributed.netns import enter_netns
from moe_overlap.overlap.baton import DboStall
from moe_overlap.runtime.eplb_rebalance import Rebalancer
from moe_overlap.runtime.expert_load import expert_load
from moe_overlap.runtime.rank import RankSpec, build_rank_runner, probe_all_to_all, serve_step

STUCK = (DboStall, CollectiveAborted, CollectiveTimeout)  # errors a collective left behind


def _log_to_stderr(rank: int) -> None:
    """Our log lines on the stderr the driver shares: rank 0's start-up lines (the FP8 load,
    decode without CUDA graphs) and every rank's warnings. A forked rank has no handler else."""
    ours = logging.getLogger("moe_overlap")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"moe-overlap rank {rank}: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        ours.propagate = False


def rank_main(spec: EngineSpec, rank: RankSpec, conn: Connection) -> None:
    """Serve ``("step", ...)``, ``("probe", ...)``, ``("experts", action)`` and
    ``("eplb", layers_per_chunk)``, ``("eplb-window",)`` until ``("stop",)`` or the driver
    leaves."""
    # Ctrl-C in a terminal reaches the whole process group, and so does the SIGTERM of
    # ``timeout``, ``kill -- -PGID`` or systemd: the driver decides what stops (a server
    # drains its requests first, which needs its ranks)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(rank.threads)
    _log_to_stderr(rank.rank)
    try:
        if rank.netns:
            enter_netns(rank.netns)
        if rank.ifname:  # loopback for ranks on one machine: nothing listens beyond it
            os.environ["GLOO_SOCKET_IFNAME"] = rank.ifname
        runner = build_rank_runner(spec, rank)
        eplb = Rebalancer.of(runner.model, runner.group, spec.placement)  # --enable-eplb
        conn.send(("ready", rank.rank))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "probe":
                _, num_bytes, repeats, p2p = msg
                link = runner.dispatcher.link
                conn.send(("ok", probe_all_to_all(runner.group, num_bytes, repeats, p2p, link)))
            elif msg[0] == "experts":
                conn.send(("ok", expert_load(runner.model, msg[1])))
            elif msg[0] in ("eplb", "eplb-window"):
                if eplb is None:
                    raise ValueError("online EPLB is off on this rank (no --enable-eplb)")
                conn.send(("ok", eplb.step(msg[1]) if msg[0] == "eplb" else eplb.restart_window()))
            else:
                group = spec.parallel.batch_of(rank.rank)
                answers = spec.parallel.answers(rank.rank)
                conn.send(("ok", serve_step(runner, msg[1], group, answers)))
    except EOFError:
        pass  # the driver went away; just exit
    except BaseException as exc:  # report anything, then die: the driver stops every rank
        with contextlib.suppress(OSError):
            refusal = isinstance(exc, ConfigError | CheckpointError)  # named: no traceback
            trace = "" if refusal else traceback.format_exc()
            conn.send(("error", rank.rank, f"{type(exc).__name__}: {exc}", trace))
        if isinstance(exc, STUCK):  # a thread may still sit in a collective: tearing the
            os._exit(1)  # group down could wait on it, so leave now (reported above)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_fd(fd: int) -> None:
    """Read this rank's specs from the driver's socket ``fd``, then serve it."""
    conn = Connection(fd)
    try:
        spec, rank = pickle.loads(conn.recv_bytes())
    except EOFError:  # the driver went away before it sent them (Ctrl-C while starting)
        return
    rank_main(spec, rank, conn)


if __name__ == "__main__":
    serve_fd(int(sys.argv[1]))
