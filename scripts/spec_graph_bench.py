"""Greedy decode with and without CUDA graphs, plain and speculative, on one GPU: the figures
``scripts/gpu_figures.sh``'s ``spec-graphs`` step reports.

Usage: python scripts/spec_graph_bench.py HF_CONFIG ALGORITHM [BATCHES] [NEW_TOKENS]
  ALGORITHM: NGRAM or EAGLE (the config needs MTP layers); BATCHES: a comma list (default 1,8,32)

One engine (bf16, one process, seeded random weights) serves every run: speculation is switched
off on the driver for the plain runs and the runner's graphs (its decode graphs and, with MTP,
its drafter's) are set aside for the eager ones, so the four variants share the weights, the
prompts (a random phrase repeated, where n-gram drafts find matches) and the captured graphs.
Each case is warmed up once (which captures its graphs), then timed; the runs alternate and
the best of REPEATS counts. Each line gives tokens/s and the ratio to the eager run of the same
variant, the acceptance length, and whether every variant gave plain eager decoding's tokens.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.tools.bench_spec import repetitive_prompts

REPEATS = int(os.environ.get("REPEATS", "3"))
DEVICE = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu: a smoke test (no graphs there)
PROMPT = 64  # tokens per prompt


def switch(llm: LLM, speculative: bool, graphs: bool, kept: dict) -> None:
    """Set ``llm`` to one variant; ``kept`` holds what was set aside."""
    runner = llm.executor.runner
    llm.scheduler.speculation = kept["speculation"] if speculative else None
    runner.graphs = kept["graphs"] if graphs else None
    if runner.mtp is not None:
        runner.mtp.graphs = kept["draft_graphs"] if graphs else None


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    sync = torch.cuda.synchronize if DEVICE == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    sync()
    return time.perf_counter() - start, tokens


def bench(llm: LLM, batch: int, new_tokens: int, vocab: int) -> None:
    runner = llm.executor.runner
    kept = {
        "speculation": llm.scheduler.speculation,
        "graphs": runner.graphs,
        "draft_graphs": None if runner.mtp is None else runner.mtp.graphs,
    }
    prompts = repetitive_prompts(batch, PROMPT, vocab, seed=0)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    variants = [(s, g) for s in (False, True) for g in (False, True)]
    best: dict[tuple[bool, bool], float] = {}
    tokens: dict[tuple[bool, bool], list] = {}
    stats = kept["speculation"].stats
    accepted0, verifications0 = stats.accepted_tokens, stats.verifications
    for repeat in range(REPEATS + 1):  # the first round warms up (and captures)
        for variant in variants:
            switch(llm, *variant, kept)
            seconds, tokens[variant] = timed(llm, prompts, params)
            if repeat:
                best[variant] = min(best.get(variant, seconds), seconds)
    switch(llm, True, True, kept)
    verifications = stats.verifications - verifications0
    accept = (stats.accepted_tokens - accepted0 + verifications) / max(verifications, 1)
    same = all(t == tokens[(False, False)] for t in tokens.values())
    rate = {v: batch * new_tokens / s for v, s in best.items()}
    for spec in (False, True):
        eager, graphed = rate[(spec, False)], rate[(spec, True)]
        name = "speculative" if spec else "plain"
        print(
            f"batch {batch:3d} {name:11s}: eager {eager:9.1f} tok/s, graphs {graphed:9.1f} "
            f"tok/s ({graphed / eager:.2f}x)"
        )
    print(
        f"batch {batch:3d} speculative/plain with graphs {rate[(True, True)] / rate[(False, True)]:.2f}x, "
        f"eager {rate[(True, False)] / rate[(False, False)]:.2f}x; acceptance length {accept:.2f}; "
        f"every variant plain eager decoding's tokens: {same}"
    )


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def main() -> None:
    path, algorithm = sys.argv[1], sys.argv[2]
    batches = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "1,8,32").split(",")]
    new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 64
    cfg = ModelConfig.from_hf(path)
    spec = {"speculative_algorithm": algorithm}
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    kw = dict(device=DEVICE, dtype=dtype, seed=0, enable_prefix_caching=False)
    with LLM(
        config=cfg, max_num_seqs=max(batches), cuda_graph_max_bs=max(batches), **kw, **spec
    ) as llm:
        runner = llm.executor.runner
        draft_graphs = None if runner.mtp is None else runner.mtp.graphs
        print(
            f"== {os.path.basename(path)}, {algorithm}: {device_name()}, "
            f"decode graphs {runner.graphs is not None}, MTP draft graphs "
            f"{draft_graphs is not None}"
        )
        for batch in batches:
            bench(llm, batch, new_tokens, cfg.vocab_size)
        if runner.graphs is not None:
            widths = sorted({key[0].width for key in runner.graphs.graphs})
            print(
                f"graphs captured: {len(runner.graphs.graphs)} (rows per sequence {widths}), "
                f"failed captures {runner.graphs.failed}"
            )


if __name__ == "__main__":
    main()
