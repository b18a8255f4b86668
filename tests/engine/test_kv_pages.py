"""The paged KV cache in the engine: a pool too small for every running decode preempts by
recompute and still gives every request the tokens an ample pool gives."""

from __future__ import annotations

import logging

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from tests.helpers import TINY

PROMPTS = [[1, 5, 9, 13, 2, 8, 30, 31, 40, 41, 7, 3], [4, 4, 2, 7], [9] * 11, [70, 12, 3]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


def generate(family: str, **kw) -> tuple[list[list[int]], int]:
    with LLM(config=ModelConfig(**TINY[family]), seed=0, max_model_len=48, **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        return [o.token_ids for o in outs], llm.scheduler.preemptions


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_pool_too_small_for_every_decode_preempts_and_gives_the_same_tokens(family, caplog):
    ample, none = generate(family, page_size=4)
    # 12 pages of 4 tokens: each sequence grows to 23-32 tokens, 6-8 pages
    with caplog.at_level(logging.INFO, logger="moe_overlap.engine.scheduler"):
        tight, preempted = generate(family, page_size=4, max_total_tokens=48)
    assert none == 0 and preempted > 0
    assert tight == ample
    assert "by recompute: rank 0 is out of KV pages" in caplog.text
