"""Attention of a chunk after a prefix (TBO's second chunk, a later prefill chunk, a prefix-cache
hit, a verify step) on a GPU: the engine's ``causal_attention`` (torch's lower-right
``CausalBias``: FlashAttention, or the memory-efficient kernel's lower-right mode) against SDPA
with the boolean lower-right mask the engine passed before, in one run: the figure
``scripts/gpu_figures.sh``'s ``attention`` step reports.

Usage: python scripts/prefix_attention_bench.py  (DEVICE=cpu: a smoke test of the script)

Shapes: Qwen3-30B-A3B's attention (32 query heads sharing 4 KV heads, head size 128) and
DeepSeek-V3's MLA with 16 heads on a rank (query and key heads 192 wide, values 128), bf16;
MLA takes the boolean mask in the engine too (the bias ran at half its speed on an H200).
Then GPT-OSS's full layers (64 query heads on 8 KV heads, head size 64, a learned sink per head):
the engine's ``sink_attention`` (SDPA, the sink one more key) against the sink written out in
fp32 scores over blocks of 256 queries (``extend_attention``, which ran these layers before).
Each line gives both times (the best of REPEATS after a warm-up, between synchronisations)
and each result's largest difference from an fp32 reference.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from moe_overlap.model import layers
from moe_overlap.model.layers import causal_attention
from moe_overlap.model.window_attention import extend_attention, sink_attention

DEVICE = os.environ.get("DEVICE", "cuda")
REPEATS = int(os.environ.get("REPEATS", "5"))
# name: (sequences, new queries, prefix, query heads, KV heads, q/k head size, value head size)
SHAPES = {
    "qwen3-30b tbo 2nd chunk of 8192": (1, 4096, 4096, 32, 4, 128, 128),
    "qwen3-30b tbo 2nd chunk of 3072": (1, 1536, 1536, 32, 4, 128, 128),
    "qwen3-30b prefix hit 1024 + 512": (4, 512, 1024, 32, 4, 128, 128),
    "qwen3-30b verify 64 x 4 at 1024": (64, 4, 1020, 32, 4, 128, 128),
    "deepseek-v3 mla 2nd chunk of 4096": (1, 2048, 2048, 16, 16, 192, 128),
}

# name: (new queries, prefix); one sequence
SINK_SHAPES = {
    "gpt-oss full layer, prompt of 8192": (8192, 0),
    "gpt-oss tbo 2nd chunk": (4096, 4096),
}


def masked(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """What the engine ran before: SDPA with a boolean lower-right mask."""
    new, length = q.shape[1], k.shape[1]
    mask = torch.ones(new, length, dtype=torch.bool, device=q.device).tril(length - new)
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def best_ms(fn, *args) -> float:
    fn(*args)  # warm-up
    times = []
    for _ in range(REPEATS):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(*args)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def compare(name: str, shape: tuple, gen: torch.Generator, dtype: torch.dtype) -> None:
    n, new, prefix, heads, kv_heads, d, dv = shape
    length = new + prefix
    q = torch.randn(n, new, heads, d, generator=gen, device=DEVICE)
    k = torch.randn(n, length, kv_heads, d, generator=gen, device=DEVICE)
    v = torch.randn(n, length, kv_heads, dv, generator=gen, device=DEVICE)
    scale = d**-0.5
    ref = masked(q, k, v, prefix, scale)
    args = tuple(t.to(dtype) for t in (q, k, v)) + (prefix, scale)
    ms, diff = {}, {}
    for label, fn in (("mask", masked), ("engine", causal_attention)):
        ms[label] = best_ms(fn, *args)
        diff[label] = (fn(*args).float() - ref).abs().max().item()
    print(
        f"{name}: engine {ms['engine']:.3f} ms ({diff['engine']:.2e}), boolean mask "
        f"{ms['mask']:.3f} ms ({diff['mask']:.2e}), {ms['mask'] / ms['engine']:.2f}x"
    )


def compare_sinks(name: str, new: int, prefix: int, gen, dtype: torch.dtype) -> None:
    q = torch.randn(1, new, 64, 64, generator=gen, device=DEVICE)
    k, v = (torch.randn(1, prefix + new, 8, 64, generator=gen, device=DEVICE) for _ in range(2))
    sinks, scale = torch.randn(64, generator=gen, device=DEVICE), 64**-0.5
    ref = extend_attention(q, k, v, prefix, 0, scale, 0, sinks)
    q, k, v, sinks = (t.to(dtype) for t in (q, k, v, sinks))
    runs = {
        "engine": lambda: sink_attention(q, k, v, prefix, scale, sinks, {}),
        "written out": lambda: extend_attention(q, k, v, prefix, 0, scale, 0, sinks),
    }
    ms = {label: best_ms(fn) for label, fn in runs.items()}
    diff = {label: (fn().float() - ref).abs().max().item() for label, fn in runs.items()}
    print(
        f"{name}: engine {ms['engine']:.3f} ms ({diff['engine']:.2e}), written out "
        f"{ms['written out']:.3f} ms ({diff['written out']:.2e}), "
        f"{ms['written out'] / ms['engine']:.2f}x"
    )


@torch.inference_mode()
def main() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    print(f"== attention after a prefix on {DEVICE}, {dtype}: ms (max |diff| from fp32)")
    for name, shape in SHAPES.items():
        compare(name, shape, gen, dtype)
    print(f"== sink attention of a full layer on {DEVICE}, {dtype}: ms (max |diff| from fp32)")
    for name, (new, prefix) in SINK_SHAPES.items():
        compare_sinks(name, new, prefix, gen, dtype)
    if layers.BIAS_REFUSED:  # the engine fell back to the boolean mask: its times are the mask's
        print(f"torch refused the lower-right causal bias: {layers.BIAS_REFUSED[0]}")


if __name__ == "__main__":
    main()
