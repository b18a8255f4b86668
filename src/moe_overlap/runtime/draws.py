"""A sampled token's probabilities and its seeded draw, shared by plain sampling and by
speculative verification, so both turn one row of logits into the same distribution and the
same draw."""

from __future__ import annotations

import torch

from moe_overlap.core.step import SampleSpec

_MIX = 0x9E3779B97F4A7C15  # spreads consecutive token indices over the seed space


def draw_seed(seed: int, index: int) -> int:
    """The seed of a request's ``index``-th draw: depends on nothing but the two, so a token
    is the same whichever rank draws it and whatever else shares its batch."""
    return (seed + index * _MIX) % (1 << 63)


def probabilities(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """One row's sampling distribution (temperature > 0): temperature, then min-p, top-k and
    top-p (vLLM's order)."""
    logits = logits.float() / spec.temperature
    if spec.min_p > 0:
        # drop what is less likely than min_p x the likeliest: logit < max + log(min_p)
        floor = logits.max() + torch.log(torch.tensor(spec.min_p))
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if spec.top_k:
        kth = torch.topk(logits, min(spec.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if spec.top_p < 1.0:
        # float64, so a top_p below float32's smallest value does not round to 0 and drop all
        sorted_probs, order = torch.sort(probs.double(), descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the likeliest token
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= spec.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(0, order, sorted_probs)
    return probs


def generator(probs: torch.Tensor, seed: int) -> torch.Generator:
    return torch.Generator(device=probs.device).manual_seed(seed)


def draw(probs: torch.Tensor, seed: int) -> int:
    """One token from ``probs`` (need not sum to 1), by the draw ``seed`` names."""
    return int(torch.multinomial(probs, 1, generator=generator(probs, seed)))
