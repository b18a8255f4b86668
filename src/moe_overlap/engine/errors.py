"""The engine's refusal of one request, and the checks of a value that raise it."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from moe_overlap.core.errors import is_finite_number, is_int


class InvalidRequestError(ValueError):
    """A request cannot be served as given; nothing was scheduled. ``field``: the parameter at
    fault, when one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def listed(name: str, value: object, kind: type) -> list:
    """None is an empty list and a lone string one stop string; other values must be lists."""
    if value is None:
        return []
    if kind is str and isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(f"{name}={value!r:.40} must be a list of {kind.__name__}s", name)
    return list(value)


def check_integer(name: str, value: object, minimum: int, note: str = "") -> None:
    if not is_int(value) or value < minimum:
        message = f"{name}={value!r} must be an integer >= {minimum}{note}"
        raise InvalidRequestError(message, name.split("[")[0])


def check_number(name: str, value: object) -> None:
    if not is_finite_number(value):
        raise InvalidRequestError(f"{name}={value!r} must be a finite number", name.split("[")[0])


def token_ids(where: str, prompt: object) -> list[int]:
    """The prompt's ids as ints; anything but a sequence of integers is refused, not converted."""
    if isinstance(prompt, torch.Tensor | np.ndarray):
        if prompt.ndim != 1 or not _integer_dtype(prompt.dtype):
            raise InvalidRequestError(
                f"{where} must be a 1-D integer array, got {prompt.ndim}-D {prompt.dtype}"
            )
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
        note = " (the model has no tokenizer for text)" if isinstance(prompt, str) else ""
        if isinstance(prompt, dict):
            note = " (of vLLM's prompt dicts, {'prompt': text} or {'prompt_token_ids': ids})"
        raise InvalidRequestError(
            f"{where} must be a list of token ids, not {type(prompt).__name__} {prompt!r:.40}"
            + note
        )
    bad = [t for t in prompt if not _is_integer(t)]
    if bad:
        raise InvalidRequestError(
            f"{where} holds {bad[0]!r} ({type(bad[0]).__name__}); token ids must be integers"
        )
    return [int(t) for t in prompt]


def prompt_ids(where: str, prompt: object, vocab: int, context: int) -> list[int]:
    """A prompt's ids, refused (naming the field ``prompt``) when empty, outside the
    vocabulary or longer than the context."""
    ids = token_ids(where, prompt)
    bad = [t for t in ids if not 0 <= t < vocab]
    if not ids:
        trouble = "is empty; give at least one token id"
    elif bad:
        trouble = f"has token ids {bad[:5]} outside the vocabulary [0, {vocab})"
    elif len(ids) > context:
        trouble = f"has {len(ids)} tokens, longer than the model's context of {context}"
    else:
        return ids
    raise InvalidRequestError(f"{where} {trouble}", "prompt")


def _integer_dtype(dtype: torch.dtype | np.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return dtype.kind in "iu"


def _is_integer(value: object) -> bool:
    """An int, a NumPy integer or a 0-D integer tensor; never a bool, float or string."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0 and _integer_dtype(value.dtype)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
