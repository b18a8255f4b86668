"""Modes as the bench and the planner name them, and as flags print them back.

A label is a registered mode's name (``none``, ``sbo``, ``dbo``, ``auto``), or a mode that
splits into micro-batches with a count and a cut: ``tbo[N][+two-chunk|+time-split]``. Plain
``tbo`` splits by whole sequences, ``+two-chunk`` may cut one (SGLang), ``+time-split`` cuts
where estimated time balances (ours); N > 2 micro-batches always cut at token level.
"""

from __future__ import annotations

import dataclasses
import re

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD, OverlapConfig
from moe_overlap.core.overlap_modes import AUTO, DBO, MODES, NONE, SBO, TBO, Runs

TWO_CHUNK, TIME_SPLIT = "+two-chunk", "+time-split"
DEFAULT_LABELS = (
    NONE.name,
    SBO.name,
    TBO.name,
    TBO.name + TWO_CHUNK,
    TBO.name + TIME_SPLIT,
    f"{TBO.name}3{TIME_SPLIT}",
    DBO.name,
    AUTO.name,
)
SERVE_LABELS = (NONE.name, TBO.name + TWO_CHUNK, DBO.name)  # bench-serve: a server per mode
_SPLIT = re.compile(rf"([a-z_-]+?)(\d*)({re.escape(TWO_CHUNK)}|{re.escape(TIME_SPLIT)})?")
_DEFAULTS = OverlapConfig()
# what a label that does not split sets besides its scheme: the split's fields at their defaults
_UNSPLIT = {
    f: getattr(_DEFAULTS, f)
    for f in ("tbo_token_distribution_threshold", "num_micro_batches", "tbo_split_policy")
}


def mode_config(label: str, base: OverlapConfig = _DEFAULTS) -> OverlapConfig:
    """The ``OverlapConfig`` a label names (module docstring): its scheme, micro-batches and
    cut, every other knob ``base``'s (the defaults; a bench passes the overlap flags it was
    given: the dispatch's form and capacity, SBO's blocks, TBO's and DBO's thresholds, ...)."""
    if label in MODES and MODES[label].runs is not Runs.SPLIT:
        return dataclasses.replace(base, mode=label, **_UNSPLIT)
    match = _SPLIT.fullmatch(label)
    name = match[1] if match else ""
    if match is None or name not in MODES or MODES[name].runs is not Runs.SPLIT:
        split = [m for m in MODES if MODES[m].runs is Runs.SPLIT]
        raise ConfigError(
            f"mode {label!r}: use {', '.join(m for m in MODES if m not in split)} or "
            + ", ".join(f"{m}[N][{TWO_CHUNK}|{TIME_SPLIT}]" for m in split)
            + f", e.g. {DEFAULT_LABELS[5]}"
        )
    parts, cut = int(match[2] or MODES[name].micro_batches), match[3] or ""
    if parts < 2:
        raise ConfigError(f"mode {label!r}: a {name} mode needs 2 or more micro-batches")
    return dataclasses.replace(
        base,
        mode=name,
        tbo_token_distribution_threshold=DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD if cut else 0.0,
        num_micro_batches=parts,
        tbo_split_policy="time" if cut == TIME_SPLIT else "tokens",
    )


def auto_choice_config(base: OverlapConfig, label: str) -> OverlapConfig:
    """The config ``auto`` runs its choice ``label`` as: ``base``'s knobs with the choice's."""
    mode, choice = MODES.auto_choices()[label]
    return dataclasses.replace(base, mode=mode.name, **dict(choice.knobs))


def auto_choice_configs(base: OverlapConfig | None = None) -> dict[str, OverlapConfig]:
    """Every variant ``auto`` may choose, by label, over ``base`` (the defaults if None)."""
    return {label: auto_choice_config(base or _DEFAULTS, label) for label in MODES.auto_choices()}


def command_flags(cfg: OverlapConfig) -> str:
    """The ``generate``/``serve`` flags that run ``cfg``: its mode's flag and each of the
    mode's knobs that differs from its default."""
    mode = MODES[cfg.mode]
    flags = [mode.flag] if mode.flag else []
    for knob in mode.knobs:
        value = getattr(cfg, knob)
        if value != getattr(_DEFAULTS, knob):
            flags.append(_flag(knob, value))
    return " ".join(flags) or "(no overlap flag)"


def _flag(knob: str, value: object) -> str:
    flag = "--" + knob.replace("_", "-")
    if isinstance(value, bool):
        return flag
    if isinstance(value, tuple):
        return f"{flag} {','.join(value)}"
    return f"{flag} {value:g}" if isinstance(value, float | int) else f"{flag} {value}"
