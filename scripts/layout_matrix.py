"""Greedy and seeded-sampled tokens of one model under many layouts, overlap modes and engine
settings at once, each against the one-process run: a wide, slow sweep for finding what the
suite's targeted exactness tests miss (it found TP under PP failing on one decoding sequence).

Usage: PYTHONPATH=src python scripts/layout_matrix.py CONFIG_JSON [KV_BYTES] [--mtp]
  KV_BYTES: a small --kv-cache-memory for the settings marked so, to force preemption
  (default: about 165 tokens of the model's KV per rank, and a hybrid model's recurrent
  states); --mtp adds MTP drafter settings.

Each setting prints OK, BAD (with the prompts whose tokens differ) or ERR (a refusal names its
flag: those are the layouts the model does not run). Four waves of prompts: six sharing a
40-token prefix (prefix caching), one of one token, nine mixed, one that is a cut prefix;
speculative settings skip the sampled wave (their draws differ by design).
"""

from __future__ import annotations

import random
import sys
import time

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.engine_config import kv_bytes_per_token, state_bytes

cfg = ModelConfig.from_hf(sys.argv[1])
args = [a for a in sys.argv[2:] if a != "--mtp"]
# about 165 tokens of KV a rank, beside the recurrent states of a hybrid model's 8 sequences
default = 165 * kv_bytes_per_token(cfg) + 8 * state_bytes(cfg)
small = dict(kv_cache_memory=int(args[0]) if args else default)
rng = random.Random(1)
V = cfg.vocab_size
prefix = [rng.randrange(2, V) for _ in range(40)]
WAVES = [
    [prefix + [rng.randrange(2, V) for _ in range(rng.randrange(1, 20))] for _ in range(6)],
    [[rng.randrange(2, V)]],
    [prefix + [rng.randrange(2, V) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    + [[rng.randrange(2, V) for _ in range(rng.randrange(1, 50))] for _ in range(4)],
    [prefix[:33]],
]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(
    max_new_tokens=8, temperature=0.9, seed=7, top_k=20, repetition_penalty=1.1, n=2
)
BASE = dict(seed=0, dtype="float32", max_model_len=128, max_num_seqs=8)
SETTINGS = [
    dict(ep=2, overlap="tbo", **small),
    dict(ep=2, overlap="tbo", tbo_token_distribution_threshold=0.48, max_num_batched_tokens=24),
    dict(ep=2, overlap="sbo", speculative_algorithm="NGRAM", **small),
    dict(ep=2, overlap="dbo", dbo_decode_token_threshold=2, dbo_prefill_token_threshold=4),
    dict(tp=2, overlap="tbo", max_num_batched_tokens=24, **small),
    dict(tp=2, ep=2, overlap="tbo", a2a_mode="low_latency", max_num_batched_tokens=32),
    dict(ep=2, dp=2, tp=2, enable_dp_attention=True, overlap="tbo", **small),
    dict(pp=2, tp=2, overlap="tbo", **small),
    dict(pp=2, tp=2, ep=2, speculative_algorithm="NGRAM", max_num_batched_tokens=24),
    dict(ep=4, overlap="tbo", num_micro_batches=3, tbo_split_policy="time", **small),
    dict(ep=2, overlap="auto", max_num_batched_tokens=24, **small),
    dict(ep=2, overlap="tbo", ep_num_redundant_experts=2, **small),
    dict(ep=2, overlap="sbo", enable_pdmux=True, max_num_batched_tokens=24),
    dict(ep=2, overlap="tbo", page_size=1, **small),
    dict(ep=2, overlap="dbo", a2a_mode="low_latency", max_num_batched_tokens=128, **small),
    dict(pp=2, tp=2, ep=2, overlap="dbo", dbo_decode_token_threshold=2, **small),
    dict(ep=4, overlap="tbo", enable_eplb=True, eplb_window_size=2, a2a_mode="auto"),
]
if "--mtp" in sys.argv:
    SETTINGS += [
        dict(ep=2, dp=2, tp=2, enable_dp_attention=True, speculative_algorithm="EAGLE"),
        dict(pp=2, tp=2, speculative_algorithm="EAGLE", max_num_seqs=1),
    ]


def run(**kw) -> list[list[list[int]]]:
    with LLM(config=cfg, **(BASE | kw)) as llm:
        waves = [llm.generate(w, GREEDY) for w in WAVES]
        if "speculative_algorithm" not in kw:
            waves.append(llm.generate(WAVES[2], SAMPLED))
    return [[out.token_ids for out in wave] for wave in waves]


def main() -> None:
    reference = run()
    for kw in SETTINGS:
        start = time.perf_counter()
        try:
            got = run(**kw)
        except Exception as e:  # a refusal or a failure: either is worth reading
            print(f"ERR {kw}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        bad = [
            (w, i)
            for w, (a, b) in enumerate(zip(reference, got, strict=False))
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            if x != y
        ]
        verdict = "BAD" if bad else "OK "
        print(f"{verdict} {time.perf_counter() - start:5.1f}s {kw} {bad[:6]}", flush=True)


if __name__ == "__main__":
    main()
