"""Runs a step's per-rank batches. One process here; distributed/launch.py has the multi-rank one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_overlap.config import ModelConfig, OverlapConfig
from moe_overlap.engine.forward_batch import ForwardBatch


@dataclass
class EngineSpec:
    """What every rank needs to build its shard of the engine (picklable)."""

    config: ModelConfig
    model_path: str | None = None
    seed: int = 0
    slots_per_rank: int = 16
    max_len: int = 4096
    overlap: OverlapConfig = field(default_factory=OverlapConfig)


class LocalExecutor:
    """A single process holding every expert; no communication."""

    num_ranks = 1

    def __init__(self, spec: EngineSpec):
        from moe_overlap.engine.model_runner import ModelRunner
        from moe_overlap.model.loader import build_model
        from moe_overlap.moe.dispatch import TokenDispatcher

        model = build_model(
            spec.config, Path(spec.model_path) if spec.model_path else None, spec.seed
        )
        self.runner = ModelRunner(
            model,
            TokenDispatcher(spec.config.num_experts),
            spec.slots_per_rank,
            spec.max_len,
            spec.overlap,
        )

    def run(self, batches: list[ForwardBatch], overlap=None, record: bool = False):
        self.runner.timeline.enabled = record
        logits = self.runner.forward(batches[0], overlap)
        self.last_spans = [self.runner.timeline.take() if record else None]
        return [logits]

    def close(self) -> None:
        pass
