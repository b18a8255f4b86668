"""moe_overlap: MoE inference across expert-parallel ranks, with communication hidden behind compute.

The public names load on first use (PEP 562), so a rank process, which imports only
``moe_overlap.runtime.worker``, never pays for the engine, the tokenizer or ``transformers``.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "moe_overlap.engine.llm",
    "ConfigError": "moe_overlap.core.errors",
    "InvalidRequestError": "moe_overlap.engine.errors",
    "ModelConfig": "moe_overlap.core.model_config",
    "RequestOutput": "moe_overlap.engine.request",
    "SamplingParams": "moe_overlap.engine.request",
    "StructuredOutputs": "moe_overlap.engine.structured",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_overlap' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
