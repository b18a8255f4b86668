"""How far FP8's activation rounding alone moves a tiny random model's logits: the FP8
checkpoint run dequantized, against the same run with each W8A8-eligible linear's input
(attention's q/k/v/o projections) quantized per 1x128 group and dequantized first, as W8A8
rounds it. What a GPU's W8A8 logits can at best agree with the dequantized path by.

Usage: PYTHONPATH=src python scripts/w8a8_rounding_emulation.py [EXPERTS_PER_TOKEN]
(default: the config's 2; 8 routes every token to every expert of qwen3-moe-tiny)
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.dispatch.fp8_rows import dequantize, quantize
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.loader import build_model, save_checkpoint

CONFIG = "configs/qwen3-moe-tiny.json"
PROMPTS = [[(11 * i + 5) % 512 for i in range(n)] for n in (64, 7)]  # tests/gpu/test_fp8_cuda's
ROUNDED = ("q_proj", "k_proj", "v_proj", "o_proj")


def fp8_round(_module, args):
    x = args[0]
    q, scales = quantize(x.reshape(-1, x.shape[-1]), 128)
    return (dequantize(q, scales, 128).to(x.dtype).view_as(x), *args[1:])


def logits(path: str, dtype: str, rounded: bool) -> list[torch.Tensor]:
    with LLM(path, device="cpu", dtype=dtype) as llm:
        for name, module in llm.executor.runner.model.named_modules():
            if rounded and name.endswith(ROUNDED):
                module.register_forward_pre_hook(fp8_round)
        one = SamplingParams(temperature=0, max_new_tokens=1)
        return [o.prompt_logits.float() for o in llm.generate(PROMPTS, one, return_logits=True)]


def main() -> None:
    cfg = ModelConfig.from_hf(CONFIG)
    if len(sys.argv) > 1:
        cfg = dataclasses.replace(cfg, num_experts_per_tok=int(sys.argv[1]))
    path = tempfile.mkdtemp()
    save_checkpoint(build_model(cfg), path)
    quantize_checkpoint(path, (128, 128))
    for dtype in ("float32", "bfloat16"):
        plain, rounded = logits(path, dtype, False), logits(path, dtype, True)
        for i, (a, b) in enumerate(zip(plain, rounded, strict=True)):
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            top1 = (a.argmax(-1) == b.argmax(-1)).float().mean()
            print(f"{dtype} prompt {i}: min cosine {cos.min():.4f}, mean {cos.mean():.4f}, "
                  f"top-1 agreement {top1:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
