"""FP8 on a GPU: the weights stay resident in FP8 (at most 0.55x their bf16 bytes with the
scales), and the W8A8 path (F.scaled_mm, 1x128 activations, 128x128 weights) gives the
logits of the dequantized path within FP8's activation rounding, on the linears and, where
their widths are multiples of 128, on the routed experts (one scaled GEMM per expert)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.fp8_w8a8 import W8A8Linear, w8a8_available
from moe_overlap.model.fp8_weights import resident_bytes
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.model.moe import ExpertBank
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
CONFIG = "configs/qwen3-moe-tiny.json"  # hidden 128: the attention linears fit 128x128 blocks
PROMPTS = [[(11 * i + 5) % 512 for i in range(n)] for n in (64, 7)]
ONE = SamplingParams(temperature=0, max_new_tokens=1)


@pytest.fixture(scope="module")
def fp8_128(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_128")
    save_checkpoint(build_model(ModelConfig.from_hf(CONFIG)), path)
    quantize_checkpoint(path, (128, 128))
    return path


def test_fp8_weights_stay_resident_on_the_gpu(fp8_128):
    model = build_model(ModelConfig.from_hf(CONFIG), fp8_128, device="cuda", dtype=torch.bfloat16)
    held, bf16 = resident_bytes(model)
    assert bf16 > 0 and held <= 0.55 * bf16, (held, bf16)


def test_w8a8_logits_match_the_dequantized_path(fp8_128):
    if not w8a8_available("cuda"):
        pytest.skip("no block-scaled FP8 GEMM on this GPU/torch (needs sm90 and F.scaled_mm)")
    kw = dict(device="cuda", dtype="bfloat16", disable_cuda_graph=True)
    with LLM(fp8_128, **kw) as llm:
        scaled = [m for m in llm.executor.runner.model.modules() if isinstance(m, W8A8Linear)]
        w8a8 = llm.generate(PROMPTS, ONE, return_logits=True)
        assert scaled and not any(m.failed for m in scaled), "the W8A8 GEMM fell back"
    with LLM(fp8_128, fp8_dequant_on_the_fly=True, **kw) as llm:
        dequantized = llm.generate(PROMPTS, ONE, return_logits=True)
    for a, b in zip(w8a8, dequantized, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.prompt_logits, b.prompt_logits, dim=-1)
        print(
            f"W8A8 vs dequantized: min cosine {cos.min().item():.5f}, max |diff| "
            f"{(a.prompt_logits - b.prompt_logits).abs().max().item():.4f}"
        )
        assert cos.min().item() > 0.99


@pytest.fixture(scope="module")
def fp8_experts_128(tmp_path_factory):
    """qwen3-moe-tiny with 128-wide experts: its expert banks fit 128x128 blocks too."""
    path = tmp_path_factory.mktemp("fp8_experts_128")
    cfg = dataclasses.replace(ModelConfig.from_hf(CONFIG), moe_intermediate_size=128)
    save_checkpoint(build_model(cfg), path)
    quantize_checkpoint(path, (128, 128))
    return path


def test_w8a8_experts_match_the_dequantized_path(fp8_experts_128):
    if not w8a8_available("cuda"):
        pytest.skip("no block-scaled FP8 GEMM on this GPU/torch (needs sm90 and F.scaled_mm)")
    kw = dict(device="cuda", dtype="bfloat16", disable_cuda_graph=True)
    with LLM(fp8_experts_128, **kw) as llm:
        model = llm.executor.runner.model
        banks = [m for m in model.modules() if isinstance(m, ExpertBank) and m.w8a8]
        w8a8 = llm.generate(PROMPTS, ONE, return_logits=True)
        assert banks and not any(b.w8a8.failed for b in banks), "the expert GEMM fell back"
    with LLM(fp8_experts_128, fp8_dequant_on_the_fly=True, **kw) as llm:
        dequantized = llm.generate(PROMPTS, ONE, return_logits=True)
    for a, b in zip(w8a8, dequantized, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.prompt_logits, b.prompt_logits, dim=-1)
        print(f"W8A8 experts vs dequantized: min cosine {cos.min().item():.5f}")
        assert cos.min().item() > 0.99
