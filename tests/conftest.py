"""Shared fixtures: tiny random Hugging Face checkpoints of both families."""

from __future__ import annotations

import pytest
import torch

VOCAB = 96


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # transformers zero-initialises routers and the correction bias; make every weight matter
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype.is_floating_point and "inv_freq" not in name:
                noise = torch.randn(t.shape, generator=gen)
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    t.copy_(1.0 + 0.1 * noise)
                elif t.dim() >= 2:
                    t.copy_(noise * t.shape[-1] ** -0.5)
                else:
                    t.copy_(0.1 * noise)


def qwen3_hf_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        max_position_embeddings=256,
    )
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def deepseek_hf_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def save_hf_model(config, path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=["qwen3_moe", "deepseek_v3"])
def hf_checkpoint(request, tmp_path_factory):
    """(family, directory, the transformers model) for each family."""
    make = qwen3_hf_config if request.param == "qwen3_moe" else deepseek_hf_config
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_hf_model(make(), path)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_small")
    save_hf_model(qwen3_hf_config(), path)
    return path
