"""Speculative verification on the rank that samples: which of a sequence's drafts the target
accepts, and the token after the last accepted one. Greedy keeps the drafts equal to the
target's argmax; sampling keeps each with probability min(1, p(x) / q(x)) and, on a rejection,
draws from norm(max(0, p - q)) (Leviathan et al.; Chen et al.), so its tokens follow the
target's distribution exactly. Penalties see the drafts accepted before each row."""

from __future__ import annotations

import dataclasses

import torch

from moe_overlap.core.step import Penalties, SampleSpec
from moe_overlap.runtime.draws import draw, draw_seed, generator, probabilities
from moe_overlap.runtime.penalties import penalised, some_allowed


def verify_greedy(rows: torch.Tensor, drafts: tuple[int, ...]) -> list[int]:
    """Greedy verification: the target's argmax of each row while the draft before it was
    accepted, i.e. the longest prefix of ``drafts`` equal to the target's picks, plus the
    bonus token (the pick after the last accepted draft)."""
    picks = rows.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == picks[accepted]:
        accepted += 1
    return picks[: accepted + 1]


def verify(
    rows: torch.Tensor, spec: SampleSpec, draft_probs: torch.Tensor | None = None
) -> list[int]:
    """The tokens a verify forward gives a sequence: its accepted drafts and the token after
    them (a rejected draft's replacement, or the bonus token after all ``k``
    ``spec.checked_drafts``). ``rows``: the ``k + 1`` logit rows (a structured output's
    already masked), row j predicting the token after draft j - 1. ``draft_probs``
    ``[k, vocab]``: the drafter's distribution q of each draft; None: one-hot drafts (n-gram)."""
    drafts = spec.checked_drafts
    if spec.temperature == 0.0 and spec.penalties is None:
        return verify_greedy(rows, drafts)
    taken: list[int] = []
    for j in range(len(drafts) + 1):
        row = rows[j]
        if spec.penalties is not None:  # the drafts accepted so far count as generated
            row = penalised(row, _with_output(spec.penalties, taken), spec.index + j)
            row = some_allowed(row, spec.allowed is not None)  # as plain sampling checks it
        seed = draw_seed(spec.seed, spec.index + j)
        if spec.temperature == 0.0:
            token = int(torch.argmax(row))
        elif j == len(drafts):
            token = draw(probabilities(row, spec), seed)  # the bonus token
        else:
            q = None if draft_probs is None else draft_probs[j]
            token = accept_or_resample(probabilities(row, spec), drafts[j], q, seed)
        taken.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return taken


def accept_or_resample(p: torch.Tensor, draft: int, q: torch.Tensor | None, seed: int) -> int:
    """One draft's verification: ``draft`` with probability min(1, p(x) / q(x)), else a draw
    from norm(max(0, p - q)), which never gives ``draft``. A one-hot draft (``q`` None) is
    decided by plain sampling's own draw of ``seed``: it equals the draft with probability
    p(x), and otherwise it is distributed as p without x, i.e. the same rule, whose tokens are
    then those plain sampling gives."""
    if q is None:
        return draw(p, seed)
    gen = generator(p, seed)
    q = q.to(p.device, p.dtype)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=p.device)
    if float(u) * float(q[draft]) < float(p[draft]):
        return draft
    residual = (p - q).clamp(min=0)  # zero at the draft: rejected only where p(x) < q(x)
    if float(residual.sum()) <= 0.0:
        return draw(p, seed)  # q equals p but for rounding: p itself
    return int(torch.multinomial(residual, 1, generator=gen))


def _with_output(pen: Penalties, accepted: list[int]) -> Penalties:
    return dataclasses.replace(pen, output_ids=pen.output_ids + tuple(accepted))
