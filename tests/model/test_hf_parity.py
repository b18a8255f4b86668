"""LLM against transformers on random tiny checkpoints: prompt logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, SamplingParams

pytest.importorskip("transformers")

PROMPTS = [[3, 17, 42, 5, 9, 60, 2], [11, 4], [7, 7, 8, 90, 33, 21, 1, 14, 55, 12, 19], [50]]


def test_prompt_logits_match_transformers(hf_checkpoint):
    _, path, hf = hf_checkpoint
    with LLM(path) as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_new_tokens=1), return_logits=True
        )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert out.prompt_logits.shape == ref.shape
        assert (out.prompt_logits - ref).abs().max().item() <= 1e-4


def test_greedy_tokens_match_transformers(hf_checkpoint):
    _, path, hf = hf_checkpoint
    with LLM(path) as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=6,
                do_sample=False,
                min_new_tokens=6,
                pad_token_id=0,
            )[0, len(prompt) :]
        assert out.token_ids == ref.tolist()
