"""Structured outputs through xgrammar: each constraint compiled once against the model's
tokenizer (kept in a bounded cache), and per request a matcher that gives the next token's
bitmask and follows every token taken.

Imported on first use (``LLM`` asks for it when a request carries a constraint): xgrammar's
import takes seconds, which a run without structured outputs never pays."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate
from typing import Protocol

import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from moe_overlap.engine.errors import InvalidRequestError

CACHED_GRAMMARS = 128  # compiled constraints kept, least recently used dropped first


class Grammars:
    """The model's compiled constraints and the matchers made from them. JSON is compiled
    without free whitespace (as vLLM's ``disable_any_whitespace``): a model may otherwise
    spend its tokens on spaces and newlines between the values."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, vocab_size: int, eos: int | None):
        stops = [eos] if eos is not None else None
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the server prepares requests on worker threads
        self._batch = xgr.BatchGrammarMatcher()  # fills on half the host's cores

    def matcher(self, kind: str, text: str, field: str) -> Matcher:
        """A fresh matcher for one request, from a constraint's kind and text
        (``StructuredOutputs.key``); InvalidRequestError names ``field`` when xgrammar refuses
        it."""
        return Matcher(self.compiled(kind, text, field), self.vocab_size, self._batch)

    def allowed(
        self, constraints: Sequence[Bitmasks], drafts: Sequence[Sequence[int]]
    ) -> list[tuple[bytes, ...]]:
        """Each constraint's ``allowed(drafts[i])``, a step's together (``walk``)."""
        matchers = [c._matcher for c in constraints if isinstance(c, Matcher)]
        if len(matchers) < len(constraints):  # not all ours: each fills its own
            return [c.allowed(d) for c, d in zip(constraints, drafts, strict=True)]
        return walk(matchers, drafts, self._batch, self.vocab_size)

    def compiled(self, kind: str, text: str, field: str) -> xgr.CompiledGrammar:
        key = kind, text
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            try:
                grammar = self._compile(kind, text)
            except Exception as exc:  # xgrammar's RuntimeError, ValueError, InvalidJSONError
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise InvalidRequestError(
                    f"{field}: this {kind} cannot be compiled: {why}"[:500], field
                ) from None
            self._cache[key] = grammar
            if len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return grammar

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        c = self._compiler
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":  # each choice a string literal, JSON's escapes being EBNF's
            return c.compile_grammar("root ::= " + " | ".join(map(json.dumps, json.loads(text))))
        return c.compile_grammar(text)


class Bitmasks(Protocol):
    """What ``Grammars.allowed`` fills: a request's constraint
    (``engine/structured.py: TokenConstraint``), by its ``allowed`` alone."""

    def allowed(self, drafts: Sequence[int] = ()) -> tuple[bytes, ...]: ...


class Matcher:
    """One request's place in its grammar (``engine/structured.py: TokenConstraint``)."""

    def __init__(
        self, grammar: xgr.CompiledGrammar, vocab_size: int, batch: xgr.BatchGrammarMatcher
    ):
        self._matcher = xgr.GrammarMatcher(grammar)
        self._vocab_size = vocab_size
        self._batch = batch

    def allowed(self, drafts: Sequence[int] = ()) -> tuple[bytes, ...]:
        return walk([self._matcher], [drafts], self._batch, self._vocab_size)[0]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the structured output's grammar")

    @property
    def done(self) -> bool:
        return self._matcher.is_terminated()


def walk(
    matchers: list[xgr.GrammarMatcher],
    drafts: Sequence[Sequence[int]],
    batch: xgr.BatchGrammarMatcher,
    vocab_size: int,
) -> list[tuple[bytes, ...]]:
    """Each matcher's bitmasks (``TokenConstraint.allowed``) for its drafts, in one bitmask
    tensor: row j of every matcher still walking filled by one batched call (on xgrammar's
    threads), then their draft j taken by another, as vLLM walks its drafts; a matcher stops at
    the first draft its grammar refuses or at one that ends it (its stop token: nothing may
    follow, and the target draws the stop token itself from the row before). At the end each
    rolls back the drafts it took, so it is where it was."""
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    rows = xgr.allocate_token_bitmask(starts[-1], vocab_size)
    taken, ended = [0] * len(matchers), [False] * len(matchers)
    walking, j = list(range(len(matchers))), 0
    while walking:
        at = [matchers[i] for i in walking]
        if len(at) == 1:  # its own call: the batched one's threads cost more than one fill
            at[0].fill_next_token_bitmask(rows, starts[walking[0]] + j)
        else:
            batch.batch_fill_next_token_bitmask(at, rows, [starts[i] + j for i in walking])
        walking = [i for i in walking if j < len(drafts[i])]
        if len(walking) == 1:
            i = walking[0]
            walking = walking if matchers[i].accept_token(drafts[i][j]) else []
        elif walking:
            tokens = [drafts[i][j] for i in walking]
            took = batch.batch_accept_token([matchers[i] for i in walking], tokens)
            walking = [i for i, ok in zip(walking, took, strict=True) if ok]
        for i in walking:
            taken[i] += 1
            ended[i] = matchers[i].is_terminated()
        walking = [i for i in walking if not ended[i]]
        j += 1
    back = [i for i, n in enumerate(taken) if n]
    if back:
        batch.batch_rollback([matchers[i] for i in back], [taken[i] for i in back])
    words = rows.numpy()
    return [
        tuple(words[start + r].tobytes() for r in range(n - end + 1))
        for start, n, end in zip(starts[:-1], taken, ended, strict=True)
    ]
