"""vLLM's ``--eplb-config`` (the JSON of its ``EPLBConfig``) read onto our EPLB settings. A key
we share sets our flag; a flag of ours set away from its default that disagrees is refused,
naming both; vLLM's keys we have no flag for are accepted at vLLM's defaults; any other key is
refused by name."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from moe_overlap.core.errors import ConfigError, is_int

# vLLM's key: (our setting, the least value)
EPLB_CONFIG_KEYS = {
    "window_size": ("eplb_window_size", 1),
    "step_interval": ("eplb_rebalance_num_iterations", 1),
    "num_redundant_experts": ("ep_num_redundant_experts", 0),
}
# vLLM's keys with no setting here: the values accepted (None: any), and why no other
AT_DEFAULTS: dict[str, tuple[tuple[Any, ...] | None, str]] = {
    "log_balancedness": (
        (False,),
        "the balancedness is not logged per step here (that reads the device every step); "
        "read it from /dump_expert_distribution_record or /metrics",
    ),
    "log_balancedness_interval": (None, ""),  # with no per-step log, any spacing is moot
    "use_async": ((False,), "experts move at a step boundary here, between steps"),
    "policy": (
        ("default",),
        "vLLM's default policy is DeepSeek's, as ours; choose ours with --eplb-algorithm",
    ),
}


def read_eplb_config(text: str | dict) -> dict[str, Any]:
    """The JSON object (or the dict given to ``LLM(eplb_config=...)``), its keys checked."""
    config: Any = text
    if not isinstance(text, dict):
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"--eplb-config={text!r} is not JSON ({exc}); want an object such as "
                '\'{"window_size": 1000, "step_interval": 3000}\''
            ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"--eplb-config={text!r}: want a JSON object of vLLM's EPLBConfig keys")
    unknown = sorted(set(config) - set(EPLB_CONFIG_KEYS) - set(AT_DEFAULTS))
    if unknown:
        known = ", ".join([*EPLB_CONFIG_KEYS, *AT_DEFAULTS])
        raise ConfigError(
            f"--eplb-config: unknown key {', '.join(map(repr, unknown))}; vLLM's EPLBConfig "
            f"keys are {known}"
        )
    for key, (allowed, why) in AT_DEFAULTS.items():
        if key in config and allowed is not None and config[key] not in allowed:
            raise ConfigError(
                f"--eplb-config's {key}={config[key]!r}: {why}; drop it or give {allowed[0]!r}"
            )
    return config


def apply_eplb_config(settings: Any, text: str | dict) -> None:
    """Set ``settings``' EPLB fields (a dataclass holding ``EplbArgs``) from ``text``'s keys."""
    config = read_eplb_config(text)
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    for key, (name, least) in EPLB_CONFIG_KEYS.items():
        if key not in config:
            continue
        theirs, ours = config[key], getattr(settings, name)
        if not is_int(theirs) or theirs < least:
            raise ConfigError(f"--eplb-config's {key}={theirs!r}: want an integer >= {least}")
        if ours != defaults[name] and ours != theirs:
            raise ConfigError(
                f"--eplb-config's {key}={theirs!r} and --{name.replace('_', '-')}={ours!r} "
                "disagree: give one of them"
            )
        setattr(settings, name, theirs)
