"""GLM-4.5-MoE (``glm4_moe``: GQA with biased q/k/v, q/k norm and half-rotary RoPE; DeepSeek-V3's
grouped sigmoid routing, shared expert and dense first layer): transformers' logits and greedy
tokens on one process, chunked prefill included, and every overlap mode at ep=2 on real gloo
ranks against one process without overlap."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.tools.bench import mode_config
from tests.family_checks import BUDGETS, CASES, ep2_modes_match_one_process, matches_transformers
from tests.helpers import (
    KW,
    PARAMS,
    glm4_hf_config,
    max_abs_diff,
    save_hf_model,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm4_moe")
    return path, save_hf_model(glm4_hf_config(), path)


@pytest.mark.parametrize("budget", BUDGETS)
def test_logits_and_greedy_tokens_match_transformers(checkpoint, budget):
    matches_transformers(*checkpoint, budget)


def test_ep2_modes_match_one_process(checkpoint):
    ep2_modes_match_one_process(ModelConfig.from_hf(checkpoint[0]))


def test_make_model_writes_a_checkpoint_transformers_reads(tmp_path):
    from transformers import AutoModelForCausalLM

    from moe_overlap.tools.cli import main

    argv = ["make-model", "--hf-config", "configs/glm4-moe-tiny.json", "--out", str(tmp_path)]
    assert main(argv) == 0
    prompt = [(11 * i + 5) % 512 for i in range(70)]
    with LLM(tmp_path) as llm:
        ours = llm.generate(
            [prompt], SamplingParams(temperature=0, max_new_tokens=1), return_logits=True
        )[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert max_abs_diff(ours.prompt_logits, ref) <= 1e-4


def test_tp2_matches_one_process(checkpoint):
    """Attention TP 2: each rank holds half the heads with their slices of the q/k/v biases."""
    cfg = ModelConfig.from_hf(checkpoint[0])
    with LLM(config=cfg, **KW) as one:
        base = one.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
    with LLM(config=cfg, tp=2, overlap=mode_config("tbo+two-chunk"), **KW) as llm:
        got = llm.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        assert max_abs_diff(a.prompt_logits, b.prompt_logits) <= 1e-4
