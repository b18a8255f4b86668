"""Join a ``torchrun`` launch (one or several machines) instead of spawning ranks.

Every process runs the same script. Rank 0 owns the scheduler: each step it broadcasts all
ranks' batches, runs its own, and gathers the sampled tokens. The other ranks serve those steps inside
``generate`` and return an empty list; ``close`` on rank 0 releases them. Engines may follow
one another in the same launch (each in a world of its own).
"""

from __future__ import annotations

import itertools
import os
from datetime import timedelta

import torch.distributed as dist

from moe_overlap.core.device import dist_backend
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.step import StepReply, StepRequest
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.rank import RankSpec, build_rank_runner, gather_replies, serve_step

_ENGINES = itertools.count()  # the engines this process started, the same on every rank


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TorchrunExecutor(Executor):
    def __init__(self, spec: EngineSpec, link: LinkSpec, timeout_s: float):
        world, par = int(os.environ["WORLD_SIZE"]), spec.parallel
        if world != par.world_size:
            raise ConfigError(
                f"torchrun started {world} processes but {par.describe()} needs "
                f"{par.world_size}; they must match"
            )
        if link.kind == "netns":
            raise ConfigError(
                f"--link {link.spec} cannot be used under torchrun: the launcher, not us, starts "
                "the ranks, so they cannot be put in network namespaces; use --link model:... "
                "(or shape the real network yourself)"
            )
        self.rank, self.num_ranks = int(os.environ["RANK"]), world
        self.num_dp, self.parallel = par.attn_dp, par
        self.owns_group = not dist.is_initialized()  # else the script's, which it closes
        if self.owns_group:
            # the launch's store under a prefix of this engine's own: torch names groups by a
            # count that starts again with each world, so an engine after one closed in the
            # same processes would meet the first's keys and wait on a peer long gone
            store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
            store = dist.PrefixStore(f"moe_overlap/engine{next(_ENGINES)}/", store)
            dist.init_process_group(
                dist_backend(spec.device),  # NCCL for CUDA tensors, gloo for the rest
                store=store,
                rank=self.rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        rank = RankSpec(self.rank, world, "env://", timeout_s, link)
        self.runner = build_rank_runner(spec, rank)
        self.is_driver = self.rank == 0
        self.closed = False

    def _broadcast(self, msg=None):
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _step(self, request: StepRequest) -> list | None:
        par = self.parallel
        mine = serve_step(self.runner, request, par.batch_of(self.rank), par.answers(self.rank))
        replies = [None] * self.num_ranks if self.is_driver else None
        dist.gather_object(mine, replies, dst=0)
        return replies

    def step(self, request: StepRequest) -> StepReply:
        self._broadcast(("step", request))
        replies = self._step(request)
        assert replies is not None  # only the driver steps
        return gather_replies(self.parallel, replies)

    def end_generate(self) -> None:
        self._broadcast(("end",))

    def serve(self) -> None:
        """On ranks > 0: run rank 0's steps until it ends this generate call (or closes)."""
        while True:
            msg = self._broadcast()
            if msg[0] != "step":
                self.closed = msg[0] == "stop"
                return
            self._step(msg[1])

    def close(self) -> None:
        if self.closed:
            return
        if self.is_driver:
            self._broadcast(("stop",))
            self.closed = True
        while not self.closed:  # ranks > 0 serve on until rank 0 says stop
            self.serve()
        self.closed = True
        dist.barrier()  # nobody tears the group down while a peer still uses it
        if self.owns_group:
            dist.destroy_process_group()
