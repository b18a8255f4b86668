"""``EngineArgs``: every engine setting (``engine/args.py`` holds the model and layout ones),
as vLLM's ``EngineArgs`` and SGLang's ``ServerArgs`` are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.kv_budget import CPU_FREE_RAM_SHARE, DEFAULT_MEM_FRACTION, DEFAULT_PAGE_SIZE
from moe_overlap.core.overlap_config import (
    OverlapConfig,
)
from moe_overlap.core.overlap_modes import MODES
from moe_overlap.engine.args import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    LayoutArgs,
    ModelArgs,
    setting,
)
from moe_overlap.engine.eplb_args import EplbArgs
from moe_overlap.engine.overlap_args import OverlapArgs
from moe_overlap.engine.spec_config import SpeculativeArgs


@dataclass
class CapacityArgs:
    max_model_len: int | None = setting(
        None,
        "longest sequence served (None: the model's max_position_embeddings)",
        aliases=("--context-length",),
        parse=int,
        group="capacity",
    )
    max_num_seqs: int = setting(
        DEFAULT_MAX_NUM_SEQS,
        "KV cache slots per rank, i.e. sequences running at once",
        aliases=("--max-running-requests",),
        group="capacity",
    )
    max_num_batched_tokens: int = setting(
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "tokens per rank per forward; longer prompts are prefilled in chunks",
        aliases=("--chunked-prefill-size",),
        group="capacity",
    )
    kv_cache_memory: int | None = setting(
        None,
        "CPU: KV cache bytes per rank (None: "
        f"{CPU_FREE_RAM_SHARE:.0%} of the memory free at start-up, split over this host's ranks)",
        aliases=("--kv-cache-memory-bytes",),
        parse=int,
        group="capacity",
    )
    mem_fraction_static: float = setting(
        DEFAULT_MEM_FRACTION,
        "GPU: share of each GPU's memory for the weights and the KV cache; the KV cache gets "
        "it less the weights",
        aliases=("--gpu-memory-utilization",),
        group="capacity",
    )
    max_total_tokens: int | None = setting(
        None,
        "KV cache tokens per rank at most (None: as many as the memory budget holds)",
        parse=int,
        group="capacity",
    )
    page_size: int = setting(
        DEFAULT_PAGE_SIZE,
        "tokens per KV cache page",
        aliases=("--block-size",),
        group="capacity",
    )
    enable_prefix_caching: bool = setting(
        True,
        "prefix caching (vLLM's automatic prefix caching, SGLang's radix cache): a request "
        "whose tokens start with full KV pages cached from earlier or running requests reuses "
        "them and prefills only the rest; pages no request holds stay cached until the pool "
        "needs them (least recently used first). Hybrid linear-attention models keep their "
        "recurrent state at a few cached page boundaries, where a hit ends (docs/serving.md). "
        "--no-enable-prefix-caching or SGLang's "
        "--disable-radix-cache turn it off (on by default, as in both)",
        negations=("--disable-radix-cache",),
        group="capacity",
    )


@dataclass
class EngineArgs(SpeculativeArgs, EplbArgs, OverlapArgs, CapacityArgs, LayoutArgs, ModelArgs):
    """Every engine setting; ``LLM(**kwargs)`` and the command line take these names."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, accepting SGLang's and vLLM's names as aliases
        (``tensor_parallel_size``, ``context_length``, ...)."""
        return cls(**cls.resolve(kwargs))

    @classmethod
    def resolve(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` by the settings' own names (aliases and negations resolved)."""
        names = {f.name for f in dataclasses.fields(cls)}
        aliases = {
            alias.lstrip("-").replace("-", "_"): f.name
            for f in dataclasses.fields(cls)
            for alias in f.metadata.get("aliases", ())
        }
        negations = {
            flag.lstrip("-").replace("-", "_"): f.name
            for f in dataclasses.fields(cls)
            for flag in f.metadata.get("negations", ())
        }
        resolved: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in negations:  # LLM(disable_radix_cache=True): the setting off
                key, value = negations[key], not value
            name = aliases.get(key, key)
            if name not in names:
                raise ConfigError(f"unknown engine setting {key!r}; see `moe-overlap serve --help`")
            if name in resolved:
                raise ConfigError(f"{key!r} and {name!r} name the same setting; give one")
            resolved[name] = value
        return resolved


def overlap_knobs() -> frozenset[str]:
    """The settings a whole ``OverlapConfig`` holds: its fields and the schemes' switches."""
    knobs = {f.name for f in dataclasses.fields(OverlapConfig)}
    return frozenset(knobs | {m.enable_field for m in MODES.values() if m.enable_field})


def without_overlap_knobs(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` less ``overlap_knobs``: to start an ``LLM`` with a whole config."""
    knobs = overlap_knobs()
    return {k: v for k, v in settings.items() if k not in knobs}
