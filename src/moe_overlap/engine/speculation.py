"""Speculative decoding on the driver: which steps verify drafts, each sequence's drafts, and
the counts ``/metrics`` and the bench read. The ranks verify (``runtime/sampler.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.kv_budget import mtp_rows_ahead, pages_for
from moe_overlap.engine.kv_pages import PageBudget
from moe_overlap.engine.ngram import propose
from moe_overlap.engine.request import Request
from moe_overlap.engine.spec_config import SpeculativeConfig


@dataclass
class SpeculationStats:
    """Counted over every sequence of a verify step (a structured output's drafts that its
    grammar refuses count as drafts, rejected)."""

    verifications: int = 0  # a sequence's drafts checked in one verify forward
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # sequences whose linear-attention state a rank rolled back past rejected drafts (Qwen3.5;
    # counted by each group's answering rank)
    rollbacks: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification gives, the bonus token included (SGLang's accept length)."""
        if not self.verifications:
            return 0.0
        return (self.accepted_tokens + self.verifications) / self.verifications


class Speculation:
    """Drafts a rank's step: a verify step when every sequence in it decodes, with the same
    number of drafts for each (SGLang's ``token_num_per_seq``), within the token budget and the
    context; a request without a match is padded with its last token. A structured output's
    drafts are proposed as any; its grammar cuts them when the step's samples are made
    (``Request.sample_spec``)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.stats = SpeculationStats()

    @classmethod
    def of(cls, config: SpeculativeConfig | None) -> Speculation | None:
        return None if config is None else cls(config)

    @property
    def writes_ahead(self) -> int:
        """Positions past a step's computed tokens the ranks write (``mtp_rows_ahead``), which
        the scheduler holds pages for; n-gram drafts none."""
        return mtp_rows_ahead(self.config.num_drafts if self.config.is_mtp else 0)

    def draft(self, reqs: list[Request], budget: int, max_len: int) -> list[list[int]] | None:
        """Each request's drafts for a verify step, or None: a plain step."""
        if not reqs or any(req.in_prefill for req in reqs):
            return None  # prefill chunks in the step: verify steps are decode-only
        room = min(max_len - req.total_len for req in reqs)
        k = min(self.config.num_drafts, budget // len(reqs) - 1, room)
        if k < 1:
            return None
        found = [self._propose(req, k) for req in reqs]
        if not any(found):
            return None
        return [
            d + [(d or req.output_ids)[-1]] * (k - len(d))
            for d, req in zip(found, reqs, strict=True)
        ]

    def _propose(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` drafts: the ranks' MTP drafts after its last step, or an n-gram match."""
        if self.config.is_mtp:
            return req.mtp_drafts[:k]
        lo, hi = self.config.lookup_min, self.config.lookup_max
        return propose(req.prompt_ids + req.output_ids, k, lo, hi)

    def draft_step(
        self, seqs: list[tuple[Request, list[int]]], budget: int, max_len: int, pool: PageBudget
    ) -> list[list[int]]:
        """A rank's step made a verify step where ``draft`` gives drafts and ``pool`` has the
        pages they grow into: each sequence's drafts, appended to the tokens it feeds, their
        pages held; else none (a plain step)."""
        drafts = self.draft([req for req, _ in seqs], budget, max_len)
        if drafts is None:
            return [[] for _ in seqs]
        ends = [  # the drafts' rows, and the MTP drafter's decode rows past them
            min(max_len, req.num_computed + len(tokens) + len(d) + self.writes_ahead)
            for (req, tokens), d in zip(seqs, drafts, strict=True)
        ]
        grow = [
            max(0, pages_for(end, pool.page_size) - req.pages)
            for (req, _), end in zip(seqs, ends, strict=True)
        ]
        if not pool.fits(sum(grow)):
            return [[] for _ in seqs]
        pool.hold(sum(grow))
        for (req, tokens), d, pages in zip(seqs, drafts, grow, strict=True):
            tokens.extend(d)
            req.pages += pages
        return drafts

    def record(self, drafts: int, accepted: int) -> None:
        self.stats.verifications += 1
        self.stats.draft_tokens += drafts
        self.stats.accepted_tokens += accepted
