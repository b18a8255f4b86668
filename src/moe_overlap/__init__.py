"""moe_overlap: MoE inference across expert-parallel ranks, with communication hidden behind compute."""

from moe_overlap.config import ConfigError, ModelConfig, ParallelConfig
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.request import InvalidRequestError, RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "ConfigError",
    "InvalidRequestError",
    "ModelConfig",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
]
