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

import torch
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

    def matcher(self, kind: str, text: str, field: str) -> Matcher:
        """A fresh matcher for one request, from a constraint's kind and text
        (``StructuredOutputs.key``); InvalidRequestError names ``field`` when xgrammar refuses
        it."""
        return Matcher(self.compiled(kind, text, field), self.vocab_size)

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


class Matcher:
    """One request's place in its grammar (``engine/structured.py: TokenConstraint``)."""

    def __init__(self, grammar: xgr.CompiledGrammar, vocab_size: int):
        self._matcher = xgr.GrammarMatcher(grammar)
        self._vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def allowed(self, drafts: Sequence[int] = ()) -> tuple[bytes, ...]:
        # one bitmask tensor, a row per draft: fill a row, take the draft, fill the next; then
        # back to where it was (vLLM's way; xgrammar's traverse_draft_tree, one call for the
        # chain, measured slower here). A draft that ends the grammar (its stop token) is not
        # verified: no row follows it, and the target draws the stop token itself.
        rows = self._rows(len(drafts) + 1)
        self._matcher.fill_next_token_bitmask(rows, 0)
        taken = 0
        for token in drafts:
            if not self._matcher.accept_token(token):
                break
            taken += 1
            if self._matcher.is_terminated():
                break
            self._matcher.fill_next_token_bitmask(rows, taken)
        kept = taken - self._matcher.is_terminated()
        if taken:
            self._matcher.rollback(taken)
        words = rows.numpy()
        return tuple(words[j].tobytes() for j in range(kept + 1))

    def _rows(self, n: int) -> torch.Tensor:
        if self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(n, self._vocab_size)
        return self._bitmask

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the structured output's grammar")

    @property
    def done(self) -> bool:
        return self._matcher.is_terminated()
