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


# a request's own settings leave its next token no choice (a sampled row's failure, said by the
# rank, answered by the server as the client's error, 400, not the server's)
NOTHING_ALLOWED = (
    "no token is allowed: the structured output allows only a stop token here, which "
    "min_tokens holds back (or logit_bias removed what it allows); lower min_tokens"
)


class NothingAllowedError(ValueError):
    """A row its grammar's bitmask and penalties leave without a token (``NOTHING_ALLOWED``)."""

    def __init__(self) -> None:
        super().__init__(NOTHING_ALLOWED)
