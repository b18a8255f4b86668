"""The flags every command shares, generated from the engine's settings dataclasses
(``engine/args.py``, ``engine/engine_args.py``), and how they become an ``LLM``."""

from __future__ import annotations

import argparse
from typing import Any

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.workloads import Workload
from moe_overlap.engine.args import LayoutArgs, ModelArgs
from moe_overlap.engine.engine_args import CapacityArgs, EngineArgs
from moe_overlap.engine.eplb_args import EplbArgs
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.overlap_args import OverlapArgs
from moe_overlap.engine.spec_config import SpeculativeArgs
from moe_overlap.tools.flags import add_fields, from_args


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model flags; whether one was given is checked where it is used (``model_source``)."""
    add_fields(p, ModelArgs)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_fields(p, LayoutArgs)
    add_fields(p, CapacityArgs)
    add_fields(p, OverlapArgs)
    add_fields(p, EplbArgs)
    add_fields(p, SpeculativeArgs)


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """The parsed flags as settings; fields a command has no flag for keep their defaults."""
    return from_args(EngineArgs, args)


def model_path(args: argparse.Namespace) -> str:
    """Where the model's config comes from: the checkpoint or the config.json."""
    model, hf_config = engine_args(args).model_source()
    return model or hf_config  # type: ignore[return-value]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM``'s keyword arguments: the settings' names, one for one."""
    settings = engine_args(args)
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}


def bench_engine_kwargs(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """``engine_kwargs`` sized to hold one forward of ``workload``, as the benches start their
    engines (without overlap: each mode's config comes with its forwards)."""
    sized = {
        "max_num_seqs": max(len(lengths) for lengths in workload.lengths),
        "max_model_len": workload.longest,
    }
    return engine_kwargs(args) | sized


def build_llm(args: argparse.Namespace) -> LLM:
    return LLM(**engine_kwargs(args))


def mode_configs(args: argparse.Namespace, modes: list[str]) -> dict[str, OverlapConfig]:
    """Each mode's overlap settings (a bench's): its label's, with the overlap flags given
    (``--a2a-mode`` and its capacity, ``--moe-a2a-backend``, ``--moe-dispatch-dtype``, ...)."""
    base = engine_args(args).overlap_config()
    if base.mode != NONE.name:  # --overlap or an --enable flag: the labels would override it
        raise ConfigError(
            f"--overlap {base.mode} (or its --enable flag) would be ignored: a bench runs each "
            f"mode of --modes; give --modes {base.mode} (or none,{base.mode})"
        )
    return {m: mode_config(m, base) for m in modes}
