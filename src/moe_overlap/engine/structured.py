"""Structured outputs as a request asks for them (vLLM's ``StructuredOutputsParams``): exactly
one constraint, a JSON schema, any JSON object, a regular expression, a list of choices or an
EBNF grammar. Compiling one and following the tokens is ``engine/grammar.py``'s (xgrammar),
imported on first use; this module holds only the plain data and the contract a request's
matcher keeps, so nothing here costs xgrammar's import."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from transformers import PreTrainedTokenizerFast

from moe_overlap.engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """One constraint on a request's output (set exactly one). ``field``: what the client called
    it (``response_format``, ``guided_json``, ``regex``...), named when it is refused."""

    json: str | dict | None = None  # a JSON schema, as text or as a dict
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF in xgrammar's dialect (GBNF), its start rule ``root``
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(f"{self.field}.json_object must be true or false", self.field)
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise InvalidRequestError(
                f"{self.field} must set exactly one of {', '.join(KINDS)} (got {set_ or 'nothing'})",
                self.field,
            )
        if isinstance(self.json, dict):
            self.json = _dumps(self.json, self.field)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(
                    f"{self.field}: {name}={value!r:.60} must be a non-empty string", self.field
                )
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, list | tuple)
            or not choice
            or not all(isinstance(c, str) and c for c in choice)
        ):
            raise InvalidRequestError(
                f"{self.field}: choice={choice!r:.60} must be a list of non-empty strings",
                self.field,
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by: the kind and its text."""
        kind = self.kind
        if kind == "choice":
            return kind, json.dumps(list(self.choice or []))
        return kind, "" if kind == "json_object" else str(getattr(self, kind))


class TokenConstraint(Protocol):
    """A request's matcher: the tokens allowed next, advanced by each token it takes."""

    def allowed(self, drafts: Sequence[int] = ()) -> tuple[bytes, ...]:
        """The next token's bitmask (bit ``t % 32`` of little-endian int32 word ``t // 32`` set
        when token ``t`` may come next), then the bitmask after each of ``drafts`` while the
        grammar allows them: one more than the drafts it allows before the first it refuses
        (or the one that would end it: its stop token). Its place in the grammar is left as it
        was."""
        ...

    def accept(self, token: int) -> None:
        """Advance past ``token``; raises ValueError when the grammar does not allow it."""
        ...

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token taken: nothing may follow."""
        ...


# fills constraints' bitmasks for their drafts (``TokenConstraint.allowed``), a step's at once
BitmaskFill = Callable[
    [Sequence[TokenConstraint], Sequence[Sequence[int]]], list[tuple[bytes, ...]]
]


class Constraints:
    """The model's structured outputs: xgrammar and the tokenizer's table are loaded at the
    first request that asks for one."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast | None, vocab_size: int, eos: int | None):
        self._args = tokenizer, vocab_size, eos
        self._make: Callable[[str, str, str], TokenConstraint] | None = None
        self._fill: BitmaskFill | None = None
        self._lock = threading.Lock()

    def matcher(self, so: StructuredOutputs, where: str) -> TokenConstraint:
        """A new request's matcher; InvalidRequestError names ``where`` and the field when the
        constraint cannot be compiled or the model has no tokenizer."""
        tokenizer, vocab_size, eos = self._args
        if tokenizer is None:
            message = f"{where}: {so.field} (structured outputs) needs a model with a tokenizer"
            raise InvalidRequestError(message, so.field)
        with self._lock:
            if self._make is None:
                from moe_overlap.engine.grammar import Grammars  # xgrammar: seconds to import

                grammars = Grammars(tokenizer, vocab_size, eos)
                self._make, self._fill = grammars.matcher, grammars.allowed
        try:
            return self._make(*so.key(), so.field)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}", exc.field) from None

    def allowed(
        self, constraints: Sequence[TokenConstraint], drafts: Sequence[Sequence[int]]
    ) -> list[tuple[bytes, ...]]:
        """Each constraint's ``allowed(drafts[i])``, filled together (xgrammar's batched fill):
        a step's structured sequences at once."""
        if self._fill is None:  # none made here: each fills its own
            return [c.allowed(d) for c, d in zip(constraints, drafts, strict=True)]
        return self._fill(constraints, drafts)


def _dumps(schema: dict, field: str) -> str:
    try:
        return json.dumps(schema)  # in its order: the properties come out in it
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{field}: the schema is not JSON: {exc}", field) from None
