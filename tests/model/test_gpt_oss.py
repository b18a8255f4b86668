"""GPT-OSS (``gpt_oss``: attention with learned sinks, sliding-window and full layers, YaRN RoPE,
biases everywhere; top-k-then-softmax routing; biased experts with a clamped SwiGLU):
transformers' logits and greedy tokens on one process, chunked prefill and a prompt longer
than the window included; every overlap mode at ep=2 on real gloo ranks against one process
without overlap; the Hub's layout, and its MXFP4 checkpoints refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from tests.family_suite import (
    BUDGETS,
    PROMPTS,
    ep2_modes_match_one_process,
    layout_matches_one_process,
    made_model_matches_transformers,
    matches_transformers,
)
from tests.helpers import (
    gpt_oss_hf_config,
    max_abs_diff,
    save_hf_model,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, save_hf_model(gpt_oss_hf_config(), path)


@pytest.mark.parametrize("budget", BUDGETS)
def test_logits_and_greedy_tokens_match_transformers(checkpoint, budget):
    matches_transformers(*checkpoint, budget)


def test_the_window_and_sinks_matter(checkpoint):
    """The oracle would not see a lost window or sink: without either, the logits move."""
    path, hf = checkpoint
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        ref = hf(prompt).logits[0]
        hf.config.sliding_window = 10_000
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = 10_000
        no_window = hf(prompt).logits[0]
        hf.config.sliding_window = 128
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = hf.config.sliding_window
    assert max_abs_diff(no_window[200:], ref[200:]) > 1e-2


def test_ep2_modes_match_one_process(checkpoint):
    ep2_modes_match_one_process(ModelConfig.from_hf(checkpoint[0]))


def test_make_model_writes_a_checkpoint_transformers_reads(tmp_path):
    # 200 tokens: past the 128-token window
    made_model_matches_transformers("configs/gpt-oss-tiny.json", tmp_path, 200)


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2), dict(tp=2, dp=2, enable_dp_attention=True), dict(pp=2)],
    ids=["tp2", "dp-attention+moe-tp", "pp2"],
)
def test_other_layouts_match_one_process(checkpoint, layout):
    """Attention TP (each rank half the heads and their sinks, the o_proj bias added once after
    the all-reduce), DP attention with moe-TP (the down bias added by one moe-TP rank) and two
    pipeline stages, under two-chunk TBO."""
    layout_matches_one_process(ModelConfig.from_hf(checkpoint[0]), layout)


def test_mxfp4_checkpoints_are_refused_with_the_fix(checkpoint, tmp_path):
    path, _ = checkpoint
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="quant_method='mxfp4'.*dequantize=True"):
        LLM(tmp_path)


def test_the_hubs_config_reads_as_the_same_model():
    """The Hub's GPT-OSS config.json spells RoPE as rope_scaling + rope_theta and the top-k as
    experts_per_token."""
    ours = json.loads(Path("configs/gpt-oss-tiny.json").read_text())
    params = ours.pop("rope_parameters")
    hub = ours | {
        "rope_theta": params.pop("rope_theta"),
        "rope_scaling": params,
        "experts_per_token": ours.pop("num_experts_per_tok"),
    }
    assert ModelConfig.from_hf(hub) == ModelConfig.from_hf("configs/gpt-oss-tiny.json")


def test_planner_caps_sliding_layers_at_the_window():
    """Half the layers slide over 128 keys: the cost model's pairs per token stop growing there
    for them, and the planner's attention core grows half as fast with the context."""
    from moe_overlap.core.model_flops import ModelFlops, op_sizes
    from moe_overlap.planner.cluster import load_cluster, presets
    from moe_overlap.planner.costs import CostModel
    from moe_overlap.planner.inputs import ModelSpec, PlanLayout
    from moe_overlap.planner.work import Work

    cfg = ModelConfig.from_hf("configs/gpt-oss-tiny.json")
    full = ModelConfig.from_hf(cfg.to_hf() | {"layer_types": ["full_attention"] * 4})
    sizes = op_sizes(cfg)
    assert (sizes.sliding_share, sizes.window) == (0.5, 128)
    flops = ModelFlops.for_model(cfg)
    assert flops.per_pair == flops.window_pair == 0.5 * ModelFlops.for_model(full).per_pair

    def growth(model: ModelConfig) -> float:
        costs = CostModel(
            ModelSpec(model, "g", False), load_cluster(presets()[0]), PlanLayout(1, 1, 1)
        )

        def core(context: int) -> float:
            batch = ForwardBatch(torch.zeros(64, dtype=torch.long), [0], [context], [64], [False])
            return costs.op_seconds(Work.of(batch, 1, False, costs.sizes.window), 64.0)["attn_core"]

        return core(65536) - core(1024)

    assert 0.45 < growth(cfg) / growth(full) < 0.55


@pytest.mark.parametrize("prefix,new", [(0, 7), (5, 10), (40, 300)])
def test_a_full_layers_sink_as_one_more_sdpa_key_is_the_written_out_softmax(prefix, new):
    """A full layer's prompt runs as SDPA with the sink as key 0 (``sink_attention``): the same
    as the sink appended to each row's scores (``extend_attention``, window 0), after a prefix
    and over more queries than one block (300 > 256), GQA's 4 heads on 2 KV heads."""
    from moe_overlap.model.window_attention import extend_attention, sink_attention

    gen = torch.Generator().manual_seed(prefix + new)
    q = torch.randn(2, new, 4, 32, generator=gen)
    k, v = (torch.randn(2, prefix + new, 2, 32, generator=gen) for _ in range(2))
    sinks = torch.randn(4, generator=gen) * 3
    scale = 32**-0.5
    fused = sink_attention(q, k, v, prefix, scale, sinks, {})
    written = extend_attention(q, k, v, prefix, 0, scale, 0, sinks)
    assert max_abs_diff(fused, written) < 1e-5
    # the sink takes weight: without it the output differs
    assert max_abs_diff(fused, extend_attention(q, k, v, prefix, 0, scale, 0, None)) > 1e-2
