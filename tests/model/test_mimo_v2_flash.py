"""MiMo-V2-Flash (``mimo_v2_flash``: sliding-window layers with sinks and twice the KV heads
beside full layers, each kind with its own RoPE base, partial RoPE, Q/K heads wider than V heads
with V scaled; DeepSeek-V3's sigmoid routing without shared experts; a dense first layer):
transformers' logits and greedy tokens on one process, chunked prefill and a prompt longer than
the window included; its own TBO strategy row; every overlap mode at ep=2 on real gloo ranks
against one process without overlap; the Hub's config and tensor names."""

from __future__ import annotations

import pytest

from moe_overlap import ModelConfig
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.strategy import build_operations, strategy_for
from tests.family_suite import (
    BUDGETS,
    ep2_modes_match_one_process,
    layout_matches_one_process,
    made_model_matches_transformers,
    matches_transformers,
)
from tests.helpers import (
    mimo_hf_config,
    save_hf_model,
)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2_flash")
    return path, save_hf_model(mimo_hf_config(), path)


@pytest.mark.parametrize("budget", BUDGETS)
def test_logits_and_greedy_tokens_match_transformers(checkpoint, budget):
    matches_transformers(*checkpoint, budget)


def test_its_own_tbo_rows_are_sglangs_mimov2_order():
    model = build_model(ModelConfig.from_hf("configs/mimo-v2-flash-tiny.json"))
    moe = next(layer for layer in model.layers if layer.is_moe)

    def stages(decode: bool) -> list[list[str]]:
        strategy = strategy_for(model, "tbo", decode)
        names = [
            getattr(op, "__name__", "|").removeprefix("op_")
            for op in build_operations(
                model, strategy, layers=range(moe.layer_id, moe.layer_id + 1)
            )
        ]
        return [part.split() for part in " ".join(names).split("|")]

    assert stages(False) == [
        [
            "prepare_attn",
            "attn_prepare",
            "attn_core",
            "prepare_mlp",
            "gate",
            "select_experts",
            "dispatch_a",
        ],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b", "output"],
    ]
    assert strategy_for(model, "tbo", True).delta_stages == 2
    assert stages(True) == [
        ["prepare_attn", "attn_prepare"],
        ["attn_core", "prepare_mlp", "gate", "select_experts"],
        ["dispatch_a"],
        ["dispatch_b", "experts", "combine_a"],
        ["combine_b", "output"],
        [],
    ]


def test_ep2_modes_match_one_process(checkpoint):
    ep2_modes_match_one_process(ModelConfig.from_hf(checkpoint[0]))


def test_make_model_writes_a_checkpoint_transformers_reads(tmp_path):
    # 200 tokens: past the window
    made_model_matches_transformers("configs/mimo-v2-flash-tiny.json", tmp_path, 200)


@pytest.mark.parametrize(
    "layout",
    [dict(tp=2), dict(tp=2, dp=2, enable_dp_attention=True), dict(pp=2)],
    ids=["tp2", "dp-attention+moe-tp", "pp2"],
)
def test_other_layouts_match_one_process(checkpoint, layout):
    """Attention TP (the full layers' one KV head replicated, the sliding layers' two split),
    DP attention with moe-TP and two pipeline stages, under two-chunk TBO."""
    layout_matches_one_process(ModelConfig.from_hf(checkpoint[0]), layout)


def test_the_hubs_config_reads_as_the_same_model():
    """The Hub's config.json: hybrid_layer_pattern, moe_layer_freq, sliding_window_size (keys
    before the query), rope_theta and swa_rope_theta, swa_num_key_value_heads,
    layernorm_epsilon."""
    ours = ModelConfig.from_hf("configs/mimo-v2-flash-tiny.json")
    renamed = ("layer_types", "mlp_layer_types", "rope_parameters", "sliding_window")
    hub = {k: v for k, v in ours.to_hf().items() if k not in (*renamed, "rms_norm_eps")} | {
        "layernorm_epsilon": ours.rms_norm_eps,
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in ours.layer_types],
        "moe_layer_freq": [int(ours.is_moe_layer(i)) for i in range(ours.num_hidden_layers)],
        "sliding_window_size": ours.sliding_window - 1,
        "rope_theta": ours.rope_theta,
        "swa_rope_theta": ours.swa_rope_theta,
        "partial_rotary_factor": ours.partial_rotary_factor,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
    }
    assert ModelConfig.from_hf(hub) == ours
