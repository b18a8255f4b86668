"""The body of one rank process: join the group, build this rank's shard, serve forward steps."""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_overlap.engine.executor import EngineSpec
from moe_overlap.engine.forward_batch import ForwardBatch
from moe_overlap.timeline import Timeline


@dataclass
class RankSpec:
    """How a rank reaches the others (picklable, sent to each spawned process)."""

    rank: int
    world_size: int
    init_method: str
    timeout_s: float
    link: object  # distributed.link.LinkSpec
    netns: str | None = None  # namespace to enter before any socket exists
    ifname: str | None = None
    threads: int = 1


def build_rank_runner(spec: EngineSpec, rank: RankSpec):
    """Join torch.distributed and build this rank's ModelRunner over its expert shard."""
    from moe_overlap.distributed.groups import init_process_groups
    from moe_overlap.distributed.layout import compute_layout
    from moe_overlap.distributed.link import ModelledLink
    from moe_overlap.engine.model_runner import ModelRunner
    from moe_overlap.model.loader import build_model
    from moe_overlap.moe.all_to_all import AllToAllDispatcher

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=rank.init_method,
            rank=rank.rank,
            world_size=rank.world_size,
            timeout=timedelta(seconds=rank.timeout_s),
        )
    n = rank.world_size
    groups = init_process_groups(compute_layout(n, 1, 1, n, 1, False), rank.rank, "gloo")
    ep_group = groups["ep"]
    model = build_model(spec.config, spec.model_path, spec.seed, ep_group.rank, n)
    link = ModelledLink.from_spec(rank.link) if rank.link.kind == "model" else None
    timeline = Timeline()
    dispatcher = AllToAllDispatcher(ep_group, spec.config.num_experts, link, timeline)
    return ModelRunner(
        model, dispatcher, spec.slots_per_rank, spec.max_len, spec.overlap, ep_group, timeline
    )


def serve_step(runner, batch: dict, overlap, record: bool):
    """One forward; returns (logits as numpy, the timeline's spans or None)."""
    runner.timeline.enabled = record
    logits = runner.forward(ForwardBatch.from_dict(batch), overlap)
    return logits.numpy(), (runner.timeline.take() if record else None)


def probe_all_to_all(
    group, num_bytes: int, repeats: int, p2p: bool | None, link=None
) -> list[float]:
    """Seconds of each of ``repeats`` all-to-alls sending ``num_bytes`` from this rank, spread
    evenly over the ranks (the share to itself never crosses the link)."""
    rows = max(group.size, num_bytes // 4 // 1024 // group.size * group.size)
    x = torch.zeros(rows, 1024)
    splits = [rows // group.size] * group.size
    times = []
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        group.all_to_all(x, splits, splits, p2p=p2p)
        if link is not None:  # the dispatcher's link model: queued, latency + bytes / rate
            link.sleep_until(link.reserve(start, x.numel() * 4 * (group.size - 1) // group.size))
        times.append(time.perf_counter() - start)
    return times


def rank_main(spec: EngineSpec, rank: RankSpec, conn) -> None:
    """Entry point of a spawned rank: serve ``("step", batch)`` until ``("stop",)``."""
    torch.set_num_threads(rank.threads)
    try:
        if rank.netns:
            from moe_overlap.distributed.link import enter_netns

            enter_netns(rank.netns)
            os.environ["GLOO_SOCKET_IFNAME"] = rank.ifname
        runner = build_rank_runner(spec, rank)
        conn.send(("ready", rank.rank))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "probe":
                link = runner.dispatcher.link
                conn.send(("ok", probe_all_to_all(runner.group, *msg[1:], link=link)))
            else:
                conn.send(("ok", serve_step(runner, *msg[1:])))
    except (EOFError, KeyboardInterrupt):
        pass  # the driver went away; just exit
    except BaseException as exc:  # report anything, then die: the driver stops every rank
        with contextlib.suppress(OSError):
            conn.send(("error", rank.rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """``python -m moe_overlap.distributed.worker FD``: FD is a socket to the driver."""
    import pickle
    import sys
    from multiprocessing.connection import Connection

    conn = Connection(int(sys.argv[1]))
    spec, rank = pickle.loads(conn.recv_bytes())
    rank_main(spec, rank, conn)


if __name__ == "__main__":
    main()
