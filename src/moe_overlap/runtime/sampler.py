"""Sampling on the rank that holds a data-parallel group's logits: each sequence's next token
(greedy, temperature, top-k, top-p) and its log-probabilities, so a step's reply carries token
ids instead of ``[batch, vocab]`` logits."""

from __future__ import annotations

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import GroupReply, SampleSpec, TokenLogprobs
from moe_overlap.runtime.penalties import penalised

_MIX = 0x9E3779B97F4A7C15  # spreads consecutive token indices over the seed space


def draw_seed(seed: int, index: int) -> int:
    """The seed of a request's ``index``-th draw: depends on nothing but the two, so a token
    is the same whichever rank draws it and whatever else shares its batch."""
    return (seed + index * _MIX) % (1 << 63)


def sample(logits: torch.Tensor, spec: SampleSpec) -> int:
    """One token from one row of logits (vLLM's rules: the likeliest token always survives
    top-p, which is compared in float64 so that a tiny top_p does not drop every token)."""
    if spec.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits.float() / spec.temperature
    if spec.top_k:
        kth = torch.topk(logits, min(spec.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs.double(), descending=True)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= spec.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator(device=probs.device).manual_seed(draw_seed(spec.seed, spec.index))
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability in one row of logits, its rank, and the ``top`` likeliest."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[token]
    rank = int((logprobs > chosen).sum()) + 1
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    pairs = (
        [] if best is None else list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    )
    return TokenLogprobs(token, float(chosen), rank, pairs)


def answer(
    batch: ForwardBatch, logits: torch.Tensor, samples: list[SampleSpec] | None, mode: str
) -> GroupReply:
    """The group's reply from its logit rows (``batch.logit_rows()``'s order): each sequence's
    scored prompt tokens, drawn token and its log-probabilities, and the rows of those that
    keep them. ``samples`` None: a forward-only step, every row comes back."""
    if samples is None:
        return GroupReply(logits=logits.cpu(), mode=mode)
    reply = GroupReply(mode=mode)
    starts, kept, row = [], [], 0
    for n, every, spec in zip(batch.extend_lens, batch.all_logits, samples, strict=True):
        rows = n if every else 1
        if spec.keep_logits:
            kept.append(torch.arange(row, row + rows))
        starts.append(row)
        row += rows
    ends = [
        start + (n if every else 1) - 1
        for start, n, every in zip(starts, batch.extend_lens, batch.all_logits, strict=True)
    ]
    greedy = [
        i for i, s in enumerate(samples) if s.draw and s.temperature == 0.0 and not s.penalties
    ]
    picked = dict(zip(greedy, logits[[ends[i] for i in greedy]].argmax(-1).tolist(), strict=True))
    for i, spec in enumerate(samples):
        reply.prompt_logprobs.append(
            [
                token_logprobs(logits[starts[i] + j], t, spec.prompt_logprobs or 0)
                for j, t in enumerate(spec.next_ids)
            ]
        )
        token, lp, error = None, None, None
        if spec.draw:
            try:
                last = logits[ends[i]]
                if spec.penalties is not None:
                    last = penalised(last, spec.penalties, spec.index)
                token = picked[i] if i in picked else sample(last, spec)
                if spec.logprobs is not None:
                    lp = token_logprobs(logits[ends[i]], token, spec.logprobs)
            except Exception as exc:  # this sequence alone fails; the driver says why
                token, error = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        reply.token_ids.append(token)
        reply.logprobs.append(lp)
        reply.errors.append(error)
    if kept:
        reply.logits = logits[torch.cat(kept)].cpu()
    return reply
