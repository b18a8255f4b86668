"""The class that runs an overlap mode, named by its entry in ``core/overlap_modes.py``.

The entry names it as ``"module:Class"`` (as vLLM's model registry names its models), so the
registry stays in ``core/`` below the classes, and a mode added there needs no table here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES
from moe_overlap.distributed.groups import Group
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.overlap.scheme import OverlapScheme

SchemeClass = Callable[[MoeForCausalLM, OverlapConfig, Group], OverlapScheme]


def scheme_class(name: str) -> SchemeClass:
    """The scheme class of the mode ``name``: built as ``cls(model, overlap_config, group)``."""
    path = MODES[name].scheme
    if path is None:
        raise ConfigError(f"overlap mode {name!r} runs the runner's plain op list: no scheme")
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
