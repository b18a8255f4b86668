"""Join a ``torchrun`` launch (one or several machines) instead of spawning ranks.

Every process runs the same script. Rank 0 owns the scheduler: each step it broadcasts all
ranks' batches, runs its own, and gathers the logits. The other ranks serve those steps inside
``generate`` and return an empty list; ``close`` on rank 0 releases them.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.device import dist_backend
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.rank import RankSpec, build_rank_runner, prefill_message, serve_step


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
        if not dist.is_initialized():
            backend = dist_backend(spec.device)  # NCCL for CUDA tensors, gloo for the rest
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        rank = RankSpec(self.rank, world, "env://", timeout_s, link)
        self.runner = build_rank_runner(spec, rank)
        self.is_driver = self.rank == 0
        self.closed = False
        self.last_spans = [None] * world

    def _broadcast(self, msg=None):
        box = [msg]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _step(self, dicts: list[dict], overlap, record: bool, prefill) -> list | None:
        group = self.parallel.batch_of(self.rank)
        batch = ForwardBatch.from_dict(dicts[group])
        wave = prefill_message(prefill, group)
        logits, spans, wave_logits = serve_step(self.runner, batch, overlap, record, wave)
        replies = [None] * self.num_ranks if self.is_driver else None
        wave_logits = None if wave_logits is None else wave_logits.numpy()
        dist.gather_object((logits.numpy(), spans, wave_logits), replies, dst=0)
        return replies

    def run(
        self,
        batches: list[ForwardBatch],
        overlap: OverlapConfig | None = None,
        record: bool = False,
        prefill=None,
    ) -> list[torch.Tensor]:
        dicts = [b.to_dict() for b in batches]
        self._broadcast(("step", dicts, overlap, record, prefill))
        replies = self._step(dicts, overlap, record, prefill)
        self.last_spans = [spans for _, spans, _ in replies]
        # one rank of each group (attention-TP rank 0 of its last stage) answers for it
        answers = [reply for r, reply in enumerate(replies) if self.parallel.answers(r)]
        self.last_prefill = [None if w is None else torch.from_numpy(w) for _, _, w in answers]
        return [torch.from_numpy(np.asarray(logits)) for logits, _, _ in answers]

    def end_generate(self) -> None:
        self._broadcast(("end",))

    def serve(self) -> None:
        """On ranks > 0: run rank 0's steps until it ends this generate call (or closes)."""
        while True:
            msg = self._broadcast()
            if msg[0] != "step":
                self.closed = msg[0] == "stop"
                return
            self._step(*msg[1:])

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
        dist.destroy_process_group()
