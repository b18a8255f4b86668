"""Decode from CUDA graphs on KV pages of 16 tokens (gathered, then SDPA; and read in place by
FlexAttention, ``--attention-backend flex_attention``) against one page per sequence (the
whole-context slot's layout, the engine's before it paged), one process, in one run: the figure
``scripts/gpu_figures.sh``'s ``paged`` step reports.

Usage: python scripts/paged_decode_bench.py HF_CONFIG [BATCH] [PROMPT] [NEW_TOKENS]
  (defaults 256, 512, 64; DEVICE=cpu: a smoke test, eager)

Each layout gets its own engine (bf16, seeded random weights, so both hold the same model) with
``--max-model-len`` PROMPT + NEW_TOKENS rounded up to a power of two, graphs up to BATCH. Decode
time is a run of NEW_TOKENS new tokens less a run of one (the prefill and the first token), best
of REPEATS after a warm-up that captures the graphs. The last lines compare each variant with
pages of 16 gathered, and say whether it gave the same greedy tokens. Every engine's pool holds what the batch needs at most
(``--max-total-tokens`` BATCH x context): FlexAttention's block mask spans the whole pool.
"""

from __future__ import annotations

import os
import sys

import torch
from spec_graph_bench import timed  # this script's folder is on sys.path

from moe_overlap import LLM, ModelConfig, SamplingParams

REPEATS = int(os.environ.get("REPEATS", "3"))
DEVICE = os.environ.get("DEVICE", "cuda")


def greedy(new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)


def decode_seconds(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    """Best decode time of ``new_tokens - 1`` steps, and the greedy tokens."""
    best = float("inf")
    for repeat in range(REPEATS + 1):  # the first round warms up (and captures)
        whole, tokens = timed(llm, prompts, greedy(new_tokens))
        first, _ = timed(llm, prompts, greedy(1))
        if repeat:
            best = min(best, whole - first)
    return best, tokens


def main() -> None:
    path = sys.argv[1]
    batch, prompt, new_tokens = (
        int(a) for a in (sys.argv[2:] + ["256", "512", "64"][len(sys.argv) - 2 :])
    )
    cfg = ModelConfig.from_hf(path)
    context = 1 << (prompt + new_tokens - 1).bit_length()
    prompts = torch.randint(
        0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0)
    )
    prompts = prompts.tolist()
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(
        f"== {os.path.basename(path)}: {name}, decode-{batch}, prompts {prompt}, {new_tokens} new, context {context}"
    )
    variants = (
        ("pages of 16", 16, "torch_native"),
        ("pages of 16, flex", 16, "flex_attention"),
        (f"one page of {context}", context, "torch_native"),
    )
    results = {}
    for label, page_size, backend in variants:
        try:
            results[label] = run(cfg, prompts, new_tokens, context, page_size, backend)
        except Exception as exc:  # one variant's failure (a kernel not here) ends only it
            print(f"{label:>18s}: failed ({type(exc).__name__}: {str(exc)[:300]})")
            continue
        seconds, _, captured = results[label]
        steps = new_tokens - 1
        print(
            f"{label:>18s}: {seconds / steps * 1e3:7.2f} ms per decode step, "
            f"{batch * steps / seconds:9.0f} tok/s, graphs captured {captured}"
        )
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    base_seconds, base_tokens, _ = results["pages of 16"]
    for label, (seconds, tokens, _) in results.items():
        if label != "pages of 16":
            print(
                f"pages of 16 against {label}: {seconds / base_seconds:.2f}x as fast; "
                f"same greedy tokens: {tokens == base_tokens}"
            )


def run(
    cfg: ModelConfig, prompts: list, new_tokens: int, context: int, page_size: int, backend: str
):
    """(decode seconds, greedy tokens, graphs captured) of one engine."""
    batch = len(prompts)
    with LLM(
        config=cfg,
        device=DEVICE,
        dtype="bfloat16" if DEVICE == "cuda" else "float32",
        seed=0,
        enable_prefix_caching=False,
        max_num_seqs=batch,
        cuda_graph_max_bs=batch,
        max_model_len=context,
        max_total_tokens=batch * context,  # the pool the batch needs (flex reads all of it)
        page_size=page_size,
        attention_backend=backend,
    ) as llm:
        seconds, tokens = decode_seconds(llm, prompts, new_tokens)
        graphs = llm.executor.runner.graphs
        return seconds, tokens, 0 if graphs is None else len(graphs.graphs)


if __name__ == "__main__":
    main()
