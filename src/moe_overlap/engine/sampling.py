"""Pick the next token from a row of logits: greedy, temperature, top-k and top-p."""

from __future__ import annotations

import torch

from moe_overlap.engine.request import SAMPLING_EPS, SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.temperature < SAMPLING_EPS:  # dividing by a tinier one overflows to inf / nan
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # float64, so a top_p below float32's smallest value does not round to 0 and drop all
        sorted_probs, order = torch.sort(probs.double(), descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the likeliest token
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(sorted_probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
