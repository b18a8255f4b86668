"""The one cost model's sizes are the model's: each op's weights per token, counted from the
parameters our model builds for every family (``core/model_flops.py``)."""

from __future__ import annotations

import pytest

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import ModelFlops, op_sizes
from moe_overlap.model.causal_lm import MoeForCausalLM

CONFIGS = ["qwen3-moe-tiny", "deepseek-v3-tiny", "qwen3_5-moe-tiny", "glm4-moe-tiny"]
# per op, the weight matrices it multiplies a token by (norms, biases, the convolution and the
# per-head scalars are too small to count)
FULL_PREPARE = ("q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
LINEAR_PREPARE = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")


def _weights(module, names: tuple[str, ...]) -> int:
    return sum(
        p.numel()
        for n, p in module.named_parameters()
        if p.dim() == 2 and n.rsplit(".", 2)[-2] in names
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_op_sizes_count_the_models_own_weights(name):
    cfg = ModelConfig.from_hf(f"configs/{name}.json")
    model, s = MoeForCausalLM(cfg), op_sizes(cfg)
    full = [x for x in model.layers if not x.is_linear]
    linear = [x for x in model.layers if x.is_linear]
    attn = full[0].attn
    assert _weights(attn, FULL_PREPARE) == s.attn_prepare
    assert _weights(attn, ("o_proj",)) == s.attn_output
    assert _weights(attn, ("kv_b_proj",)) == s.attn_up
    if linear:
        assert _weights(linear[0].attn, LINEAR_PREPARE) == s.linear_prepare
        assert _weights(linear[0].attn, ("out_proj",)) == s.linear_output
    assert s.full_share == len(full) / cfg.num_hidden_layers
    moe = next(x.mlp for x in model.layers if x.is_moe)
    bank = moe.experts
    assert sum(p.numel() for p in bank.parameters()) == s.expert * cfg.num_experts
    assert moe.gate.weight.numel() == s.gate
    shared = getattr(moe, "shared_experts", None) or getattr(moe, "shared_expert", None)
    assert (sum(p.numel() for p in shared.parameters()) if shared else 0) == s.shared
    dense = [x.mlp for x in model.layers if not x.is_moe]
    if dense:
        assert sum(p.numel() for p in dense[0].parameters()) == s.dense
    assert model.lm_head.weight.numel() == s.logits


def test_model_flops_shares_add_up_and_attention_grows_only_with_full_layers():
    for name in CONFIGS:
        cfg = ModelConfig.from_hf(f"configs/{name}.json")
        flops, s = ModelFlops.for_model(cfg), op_sizes(cfg)
        assert 0 < flops.expert_share + flops.shared_share < 1
        assert flops.expert_share * flops.per_token == pytest.approx(2 * s.top_k * s.expert)
        assert flops.per_pair == pytest.approx(s.full_share * s.pair_flops)
