"""Errors every layer may raise, and the type checks behind them; each error names the bad
value and the fix."""

import math
from typing import TypeGuard


class ConfigError(ValueError):
    """A configuration value is missing, malformed or impossible."""


def is_int(value: object) -> TypeGuard[int]:
    """A Python int that is not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """An int or float, not a bool, not NaN or infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, holds one of the wrong shape, or is unreadable."""
