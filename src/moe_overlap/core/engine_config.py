"""What every rank needs to build its shard of the engine (picklable, sent to each rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig


@dataclass
class EngineSpec:
    config: ModelConfig
    model_path: str | None = None
    seed: int = 0
    slots_per_rank: int = 16
    max_len: int = 4096
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
