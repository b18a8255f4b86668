"""What every rank needs to build its shard of the engine (picklable, sent to each rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig

DEFAULT_MAX_NUM_SEQS = 16  # KV cache slots per rank: sequences running at once
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per rank per forward


@dataclass
class EngineSpec:
    config: ModelConfig
    model_path: str | None = None
    seed: int = 0
    slots_per_rank: int = DEFAULT_MAX_NUM_SEQS
    max_len: int = 4096
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
