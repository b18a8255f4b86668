"""ModelConfig.from_hf reads both families and names the field that is wrong."""

from __future__ import annotations

import json

import pytest

from moe_overlap import ConfigError, ModelConfig
from tests.helpers import deepseek_hf_config, qwen3_hf_config


def test_reads_transformers_configs():
    q = ModelConfig.from_hf(qwen3_hf_config().to_dict())
    assert (q.model_type, q.num_experts, q.head_dim, q.mlp_only_layers) == ("qwen3_moe", 8, 8, [1])
    assert [q.is_moe_layer(i) for i in range(3)] == [True, False, True]
    d = ModelConfig.from_hf(deepseek_hf_config().to_dict())
    assert (d.num_experts, d.n_group, d.topk_group, d.scoring_func) == (8, 4, 2, "sigmoid")
    assert [d.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_round_trips_through_to_hf(tmp_path):
    for cfg in (qwen3_hf_config(), deepseek_hf_config()):
        ours = ModelConfig.from_hf(cfg.to_dict())
        (tmp_path / "config.json").write_text(json.dumps(ours.to_hf()))
        assert ModelConfig.from_hf(tmp_path) == ours


def test_reads_shipped_configs():
    types = [
        ModelConfig.from_hf(f"configs/{name}.json").model_type
        for name in ("qwen3-moe-tiny", "deepseek-v3-tiny", "qwen3-moe-bench")
    ]
    assert types == ["qwen3_moe", "deepseek_v3", "qwen3_moe"]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "llama"}, "model_type='llama' is not supported"),
        ({"hidden_size": None}, "missing the required field 'hidden_size'"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is larger than num_experts=8"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide"),
        (
            {"head_dim": None, "hidden_size": 30},
            "num_attention_heads=4 does not divide hidden_size=30",
        ),
        ({"vocab_size": 0}, "vocab_size=0 must be a positive integer"),
        ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
        ({"head_dim": -8}, "head_dim=-8 must be a positive integer"),
        ({"intermediate_size": -48}, "intermediate_size=-48 must be a positive integer"),
        ({"num_experts": 8.0}, "num_experts=8.0 must be a positive integer"),
        ({"rms_norm_eps": "abc"}, "rms_norm_eps='abc' must be a finite number"),
        ({"rms_norm_eps": 0}, "rms_norm_eps=0 must be positive"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
        ({"norm_topk_prob": 1}, "norm_topk_prob=1 must be true or false"),
        ({"mlp_only_layers": [99]}, r"mlp_only_layers=\[99\] must list layer indices in \[0, num"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers='1' must list layer indices"),
        ({"eos_token_id": -1}, "eos_token_id=-1 must be an integer >= 0"),
    ],
)
def test_qwen3_errors_name_the_field(change, match):
    raw = qwen3_hf_config().to_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 3}, "n_group=3 must be positive and divide n_routed_experts=8"),
        ({"topk_group": 5}, r"topk_group=5 must be in \[1, n_group=4\]"),
        ({"kv_lora_rank": None}, "missing the required field 'kv_lora_rank'"),
        ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3 must be even"),
        ({"first_k_dense_replace": 7}, "first_k_dense_replace=7 must be in"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 4}}, "only default RoPE"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4}},
            "YaRN's original_max_position_embeddings=None must be a positive number",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4,
                    "original_max_position_embeddings": 8,
                    "mscale_all_dim": -1,
                }
            },
            "YaRN's mscale_all_dim=-1 must be a number >= 0",
        ),
        ({"kv_lora_rank": "32"}, "kv_lora_rank='32' must be a positive integer"),
        ({"q_lora_rank": -16}, "q_lora_rank=-16 must be a positive integer"),
        ({"v_head_dim": 0}, "v_head_dim=0 must be a positive integer"),
        ({"topk_method": "bogus"}, "topk_method='bogus' must be one of greedy, noaux_tc"),
        ({"scoring_func": "tanh"}, "scoring_func='tanh' must be one of softmax, sigmoid"),
        ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor=nan must be a finite"),
        ({"n_shared_experts": -1}, "n_shared_experts=-1 must be an integer >= 0"),
    ],
)
def test_deepseek_errors_name_the_field(change, match):
    raw = deepseek_hf_config().to_dict()
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(raw)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        ModelConfig.from_hf(tmp_path)
