"""Sampling on the rank that holds a data-parallel group's logits: each sequence's next token
(greedy, temperature, top-k, top-p) and its log-probabilities, so a step's reply carries token
ids instead of ``[batch, vocab]`` logits."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import NOTHING_ALLOWED, NothingAllowedError
from moe_overlap.core.step import GroupReply, SampleSpec, TokenLogprobs
from moe_overlap.runtime.draws import draw, draw_seed, probabilities
from moe_overlap.runtime.penalties import penalised, some_allowed
from moe_overlap.runtime.verification import verify


def sample(logits: torch.Tensor, spec: SampleSpec) -> int:
    """One token from one row of logits: greedy, or temperature, min-p, top-k and top-p
    (vLLM's rules)."""
    if spec.temperature == 0.0:
        return int(torch.argmax(logits))
    return draw(probabilities(logits, spec), draw_seed(spec.seed, spec.index))


def masked(logits: torch.Tensor, allowed: Sequence[bytes]) -> torch.Tensor:
    """Rows of logits (``[rows, vocab]``, or one row ``[vocab]``), each with every token its
    bitmask in ``allowed`` (one per row) leaves out at -inf (those past the bitmask too: a
    head wider than the tokenizer's vocabulary)."""
    # little-endian words: bit t % 8 of byte t // 8 is token t's; every row's in one unpack
    words = np.frombuffer(b"".join(allowed), dtype=np.uint8).reshape(len(allowed), -1)
    bits = np.unpackbits(words, axis=1, bitorder="little")
    keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool)
    n = min(keep.shape[1], bits.shape[1])
    keep[:, :n] = torch.from_numpy(bits[:, :n]).bool()
    keep = keep.reshape(logits.shape).to(logits.device, non_blocking=True)
    return logits.masked_fill(~keep, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Row i's ``tokens[i]``: its log-probability, its rank and the ``tops[i]`` likeliest,
    for all the rows at once (one log-softmax, one copy to the host)."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = ((logprobs > chosen).sum(1) + 1).tolist()
    best = torch.topk(logprobs, min(max(tops), logprobs.shape[1]), dim=-1)
    values, indices = best.values.tolist(), best.indices.tolist()
    return [
        TokenLogprobs(t, v, r, list(zip(i[:k], w[:k], strict=True)))
        for t, v, r, i, w, k in zip(
            tokens, chosen.squeeze(1).tolist(), ranks, indices, values, tops, strict=True
        )
    ]


def answer(
    batch: ForwardBatch,
    logits: torch.Tensor,
    samples: list[SampleSpec] | None,
    mode: str,
    draft_probs: Sequence[torch.Tensor | None] = (),
) -> GroupReply:
    """The group's reply from its logit rows (``batch.logit_rows()``'s order): each sequence's
    scored prompt tokens, drawn token (and, verifying drafts, the tokens accepted after it)
    with their log-probabilities, and the rows of those that keep them. ``samples`` None: a
    forward-only step, every row comes back. ``draft_probs``: per sequence, the drafter's
    ``[k, vocab]`` distributions of its drafts (none given: one-hot drafts, as n-gram's)."""
    if samples is None:
        return GroupReply(logits=logits.cpu(), mode=mode)
    reply = GroupReply(mode=mode)
    starts, decide, kept, row = [], [], [], 0
    for n, every, spec in zip(batch.extend_lens, batch.all_logits, samples, strict=True):
        rows = n if every else 1
        if spec.keep_logits:
            kept.append(torch.arange(row, row + rows))
        starts.append(row)
        # the row that decides the next token: a verify sequence's first, else its last
        decide.append(row if spec.drafts else row + rows - 1)
        row += rows
    greedy = [
        i
        for i, s in enumerate(samples)
        if s.draw
        and s.temperature == 0.0
        and not s.penalties
        and s.allowed is None
        and not s.drafts  # a verify row's tokens come from verification
    ]
    picked = dict(zip(greedy, logits[[decide[i] for i in greedy]].argmax(-1).tolist(), strict=True))
    for i, spec in enumerate(samples):
        scores: list[TokenLogprobs] = []
        if spec.next_ids:
            scored = logits[starts[i] : starts[i] + len(spec.next_ids)]
            top = spec.prompt_logprobs or 0
            scores = token_logprobs(scored, list(spec.next_ids), [top] * len(spec.next_ids))
        reply.prompt_logprobs.append(scores)
        q = draft_probs[i] if i < len(draft_probs) else None
        pick = picked.get(i)
        tokens, error = ([pick], None) if pick is not None else _draw(logits, decide[i], spec, q)
        reply.token_ids.append(tokens[0] if tokens else None)
        reply.more_ids.append(tokens[1:])
        reply.errors.append(error)
    _add_logprobs(reply, logits, samples, decide)
    if kept:
        reply.logits = logits[torch.cat(kept)].cpu()
    return reply


def _draw(
    logits: torch.Tensor, row: int, spec: SampleSpec, draft_probs: torch.Tensor | None = None
) -> tuple[list[int], str | None]:
    """One sequence's new tokens (none where it draws none) from its deciding ``row`` on: a
    draw, or the tokens verification accepts; or why its draw failed."""
    if not spec.draw:
        return [], None
    try:
        if spec.verifies:
            rows = logits[row : row + len(spec.checked_drafts) + 1]
            if spec.allowed is not None:  # each row its grammar's after the drafts before it
                rows = masked(rows, spec.allowed)
            return verify(rows, spec, draft_probs), None
        last = logits[row]
        if spec.allowed is not None:
            last = masked(last, spec.allowed[:1])
        if spec.penalties is not None:
            last = some_allowed(
                penalised(last, spec.penalties, spec.index), spec.allowed is not None
            )
        return [sample(last, spec)], None
    except NothingAllowedError:  # a row its grammar and min_tokens leave empty
        return [], NOTHING_ALLOWED
    except Exception as exc:  # this sequence alone fails; the driver says why
        return [], f"{type(exc).__name__}: {exc}".splitlines()[0]


def _add_logprobs(
    reply: GroupReply, logits: torch.Tensor, samples: list[SampleSpec], decide: list[int]
) -> None:
    """The drawn tokens' log-probabilities, of the raw logits (never the penalised ones): a
    verified token's from the row that predicted it."""
    asked = [
        i for i, (s, t) in enumerate(zip(samples, reply.token_ids, strict=True))
        if s.logprobs is not None and t is not None
    ]  # fmt: skip
    rows: list[int] = []
    tokens: list[int] = []
    tops: list[int] = []
    for i in asked:
        first = reply.token_ids[i]
        assert first is not None  # ``asked`` holds drawn tokens only
        drawn = [first, *reply.more_ids[i]]
        rows.extend(range(decide[i], decide[i] + len(drawn)))
        tokens.extend(drawn)
        tops.extend([samples[i].logprobs or 0] * len(drawn))
    lps = iter(token_logprobs(logits[rows], tokens, tops))
    found = {i: [next(lps) for _ in range(1 + len(reply.more_ids[i]))] for i in asked}
    reply.logprobs = [found[i][0] if i in found else None for i in range(len(samples))]
    reply.more_logprobs = [found[i][1:] if i in found else [] for i in range(len(samples))]
