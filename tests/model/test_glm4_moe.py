"""GLM-4.5-MoE (``glm4_moe``: GQA with biased q/k/v, q/k norm and half-rotary RoPE; DeepSeek-V3's
grouped sigmoid routing, shared expert and dense first layer): transformers' logits and greedy
tokens on one process, chunked prefill included, and every overlap mode at ep=2 on real gloo
ranks against one process without overlap."""

from __future__ import annotations

import pytest

from moe_overlap import ModelConfig
from tests.family_suite import (
    BUDGETS,
    ep2_modes_match_one_process,
    layout_matches_one_process,
    made_model_matches_transformers,
    matches_transformers,
)
from tests.helpers import (
    glm4_hf_config,
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
    made_model_matches_transformers("configs/glm4-moe-tiny.json", tmp_path, 70)


def test_tp2_matches_one_process(checkpoint):
    """Attention TP 2: each rank holds half the heads with their slices of the q/k/v biases."""
    layout_matches_one_process(ModelConfig.from_hf(checkpoint[0]), dict(tp=2))
