"""moe_overlap: MoE inference across expert-parallel ranks, with communication hidden behind compute."""

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.request import InvalidRequestError, RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "ConfigError",
    "InvalidRequestError",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
