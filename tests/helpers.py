"""Shared test data: tiny model configs, tiny Hugging Face checkpoints, prompt cases and the
exactness check."""

from __future__ import annotations

import dataclasses
import subprocess

import torch

from moe_overlap import LLM, SamplingParams
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_config import OverlapConfig

TINY = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        vocab_size=80,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=80,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        max_position_embeddings=64,
    ),
}

CASES = {
    "single-long": [[(7 * i) % 80 for i in range(45)]],
    "short+long": [[3, 4, 5], [(5 * i + 1) % 80 for i in range(40)]],
    "mixed-batch": [[9] * 12, [1, 2], list(range(30, 60)), [70, 71, 72], [5]],
    "one-decode-token": [[11]],
}
PARAMS = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
KW = dict(seed=0, max_num_batched_tokens=24)  # small budget: chunked prefill and MIXED steps


def reference(cfg):
    with LLM(config=cfg, **KW) as llm:
        return {case: llm.generate(p, PARAMS, return_logits=True) for case, p in CASES.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item() if a.numel() else 0.0


def every_mode() -> dict[str, OverlapConfig]:
    """The bench's seven modes, DBO's vLLM thresholds (512 prefill tokens) lowered so that
    small test batches split."""
    modes = ("none", "tbo", "tbo+two-chunk", "tbo+time-split", "tbo3+time-split", "sbo")
    dbo = OverlapConfig("dbo", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4)
    return {m: mode_config(m) for m in modes} | {"dbo": dbo}


def assert_same(base, got):
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.prompt_logits - b.prompt_logits).abs().max().item() <= 1e-4


VOCAB = 96


def _randomize(model: torch.nn.Module, seed: int, centred: bool = False) -> None:
    # transformers zero-initialises routers and the correction bias; make every weight matter.
    # ``centred``: the norms (but linear attention's gated one) store the scale minus 1.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dtype.is_floating_point and "inv_freq" not in name:
                noise = torch.randn(t.shape, generator=gen)
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    zero = centred and not name.endswith("linear_attn.norm.weight")
                    t.copy_((0.0 if zero else 1.0) + 0.1 * noise)
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


def qwen3_5_hf_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # a quarter rotates: 4 dims
        linear_key_head_dim=16,
        linear_value_head_dim=16,  # 8-wide heads' gated norm amplifies float noise past 1e-4
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    return Qwen3_5MoeTextConfig(**kw)


def glm4_hf_config(**overrides):
    from transformers import Glm4MoeConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # half of it rotates
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        attention_bias=True,
        use_qk_norm=True,
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    return Glm4MoeConfig(**kw)


def save_hf_model(config, path, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    _randomize(model, seed, centred=config.model_type == "qwen3_5_moe_text")
    model.save_pretrained(path)
    return model


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def force_overlap(llm, overlap, monkeypatch=None) -> None:
    """Make every step of ``llm`` run ``overlap`` (one engine serves many modes' checks);
    a later call replaces an earlier one."""
    step = type(llm.executor).step.__get__(llm.executor)

    def forced(request):
        return step(dataclasses.replace(request, overlap=overlap))

    if monkeypatch is None:
        llm.executor.step = forced
    else:
        monkeypatch.setattr(llm.executor, "step", forced)


def gpt_oss_hf_config(**overrides):
    from transformers import GptOssConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,  # one sliding layer, one full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=128,  # the 600-token prompt crosses it
        max_position_embeddings=1024,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=32,
        ),
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kw.update(overrides)
    return GptOssConfig(**kw)


def mimo_hf_config(**overrides):
    from transformers import MiMoV2FlashConfig

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=1,  # the sliding layers have 2
        head_dim=24,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.0,
        sliding_window=128,
        attention_value_scale=0.7,
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "partial_rotary_factor": 0.334,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.334,
            },
        },
        max_position_embeddings=1024,
        eos_token_id=None,
        bos_token_id=None,
    )
    kw.update(overrides)
    return MiMoV2FlashConfig(**kw)
