"""The one-process executor: this process holds every expert; nothing is communicated."""

from __future__ import annotations

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.rank import build_rank_runner, prefill_message, serve_step


class LocalExecutor(Executor):
    num_ranks = num_dp = 1

    def __init__(self, spec: EngineSpec):
        self.runner = build_rank_runner(spec)
        self.last_spans = [None]

    def run(
        self,
        batches: list[ForwardBatch],
        overlap: OverlapConfig | None = None,
        record: bool = False,
        prefill=None,
    ) -> list[torch.Tensor]:
        wave = prefill_message(prefill, 0)
        logits, spans, wave_logits = serve_step(self.runner, batches[0], overlap, record, wave)
        self.last_spans, self.last_prefill = [spans], [wave_logits]
        return [logits]

    def close(self) -> None:
        pass
