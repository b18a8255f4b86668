"""bench-engine end to end on a tiny config (contents, not timings), and the engine's
defaults: KV cache slots bounded by a memory budget, a cache that grows with its sequences."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core.engine_config import (
    DEFAULT_MAX_NUM_SEQS,
    EngineSpec,
    kv_bytes_per_token,
)
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.kv_cache import KVCache, KVPoolExhausted
from moe_overlap.model.loader import build_model
from moe_overlap.tools.bench_engine import add_bench_engine_command
from tests.helpers import deepseek_hf_config, qwen3_hf_config

TINY_CASES = [
    "--prefill", "1x24,3x8", "--decode-batches", "2,5",
    "--decode-prompt-len", "4", "--new-tokens", "3", "--repeats", "1",
]  # fmt: skip


def run_bench_engine(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_bench_engine_command(parser.add_subparsers())
    args = parser.parse_args(["bench-engine", *argv])
    return args.func(args)


def test_bench_engine_against_transformers(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "engine.json"
    cases = ["--prefill", "3x8", "--decode-batches", "5", *TINY_CASES[4:]]  # profiled: 1 s each
    argv = ["--hf-config", "configs/qwen3-moe-tiny.json", "--compare-hf", *cases]
    assert run_bench_engine([*argv, "--threads", "1", "--breakdown", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    names = ["prefill 3x8", "decode batch 5"]
    for name in [*names, "ours tok/s", "HF tok/s", "ours/HF", "same tokens", "Where the time"]:
        assert name in table
    report = json.loads(out.read_text())
    assert report["matmul_peak_gflops"] > 0
    for case in report["cases"]:  # each engine's profiled run, split into parts of its wall
        for split, times in ((case["ours_breakdown"], case["ours_times"]),
                             (case["hf_breakdown"], case["hf_times"])):  # fmt: skip
            parts = split["matmul_s"] + split["attention_s"] + split["other_ops_s"]
            assert split["matmul_s"] > 0 and 0 < parts <= split["profiled_wall_s"]
            assert split["wall_s"] == min(times)
    assert report["threads"] == 1 and [c["name"] for c in report["cases"]] == names
    assert [c["tokens"] for c in report["cases"]] == [24, 15]
    for case in report["cases"]:
        assert case["ours_tok_s"] > 0 and case["hf_tok_s"] > 0
        assert len(case["ours_times"]) == len(case["hf_times"]) == 1
        assert case["ours_s"] == min(case["ours_times"])
        assert case["ratio"] == pytest.approx(case["ours_tok_s"] / case["hf_tok_s"])
    # same weights and prompts: greedy tokens agree with transformers
    assert [c["same_tokens"] for c in report["cases"]] == ["3/3", "5/5"]


def test_bench_engine_alone_and_bad_flags(tmp_path, capsys):
    out = tmp_path / "engine.json"
    argv = ["--hf-config", "configs/qwen3-moe-tiny.json", *TINY_CASES, "--json", str(out)]
    assert run_bench_engine([*argv, "--cpu-time"]) == 0  # timed on the process's CPU clock
    report = json.loads(out.read_text())
    assert report["cpu_time"] and all(c["ratio"] is None for c in report["cases"])
    assert "CPU time" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_bench_engine(["--hf-config", "x.json", "--prefill", "3072"])
    too_long = ["--hf-config", "configs/qwen3-moe-tiny.json", "--prefill", "1x5000"]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        run_bench_engine(too_long)
    zeros = ["--hf-config", "configs/qwen3-moe-tiny.json", "--threads", "0", "--new-tokens", "0"]
    with pytest.raises(ConfigError, match="^--threads=0, --new-tokens=0: must be >= 1$"):
        run_bench_engine(zeros)


@pytest.mark.parametrize("make", [qwen3_hf_config, deepseek_hf_config])
def test_kv_bytes_per_token_matches_the_models_cache(make):
    cfg = ModelConfig.from_hf(make().to_dict())
    entries = build_model(cfg).kv_entries()  # per layer
    assert len(entries) == cfg.num_hidden_layers
    floats = sum(torch.Size(s).numel() for layer in entries for s in layer.values())
    assert kv_bytes_per_token(cfg) == 4 * floats


def test_kv_pages_bounded_by_the_budget():
    cfg = ModelConfig.from_hf("configs/qwen3-moe-bench.json")
    per_slot = kv_bytes_per_token(cfg) * 4096  # 4 layers x 2 x 4 heads x 64 x 4 bytes
    assert per_slot == 32 * 2**20
    spec = EngineSpec(cfg, max_len=4096, kv_cache_bytes=100 * per_slot)
    assert spec.max_num_seqs == DEFAULT_MAX_NUM_SEQS == spec.num_slots
    assert spec.pool_pages == 100 * 4096 // 16 and spec.max_concurrent(4096) == 100
    assert "at once 100 sequences of max_len=4096 or 256 of 1024" in spec.kv_cache_summary()
    small = EngineSpec(cfg, max_num_seqs=8, max_len=4096)
    assert small.num_slots == 8 and small.pool_pages == 8 * 4096 // 16  # no more than used
    with pytest.raises(ConfigError, match="holds no sequence of max_len=4096"):
        EngineSpec(cfg, max_len=4096, kv_cache_bytes=per_slot - 1)


def test_kv_cache_grows_with_its_sequences():
    cache = KVCache(2, num_slots=256, max_len=4096, entries={"k": (2, 8)}, page_size=16)
    page = 16 * 2 * 8 * 4  # bytes of one page of one layer
    assert cache.allocated_bytes() == 2 * page  # the null page of each layer
    k = torch.arange(3 * 16, dtype=torch.float32).view(3, 2, 8)
    cache.reserve([1], [3])
    cache.store(0, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]), k=k)
    assert cache.allocated_bytes() == 2 * 2 * page  # one page taken, both layers grow
    cache.reserve([5], [101])  # 7 pages
    cache.store(0, torch.tensor([5]), torch.tensor([100]), k=k[:1])
    assert torch.equal(cache.gather(0, "k", slice(1, 2), 3)[0], k)  # kept across the growth
    padded = cache.gather(0, "k", torch.tensor([1, 5]), 101)
    assert padded.shape == (2, 101, 2, 8) and torch.equal(padded[1, 100], k[0])
    assert torch.equal(padded[0, 16:], torch.zeros(85, 2, 8))  # past its page: the null page
    assert cache.free_pages == cache.num_pages - 8
    cache.release([5, 1])
    assert cache.free_pages == cache.num_pages and cache.held[5] == []
    with pytest.raises(ValueError, match="exceeds the KV cache's max_len=4096"):
        cache.store(0, torch.tensor([0]), torch.tensor([4096]), k=k[:1])
    with pytest.raises(IndexError, match="slot 256 is outside"):
        cache.store(0, torch.tensor([256]), torch.tensor([0]), k=k[:1])
    tight = KVCache(1, num_slots=4, max_len=64, entries={"k": (2, 8)}, num_pages=5)
    tight.reserve([0], [64])
    with pytest.raises(KVPoolExhausted, match="slot 1 needs 2 more KV pages for 17 tokens; 1 of 5"):
        tight.reserve([1], [17])


def test_a_gather_through_the_block_table_reads_what_was_stored_from_any_start():
    cache = KVCache(1, num_slots=3, max_len=100, entries={"k": (1,)}, page_size=4)
    cache.reserve([2, 0], [50, 7])  # slot 2's pages come first, then slot 0's: not contiguous
    for slot, n in ((2, 50), (0, 7)):
        values = torch.arange(n, dtype=torch.float32).view(n, 1) + 100 * slot
        cache.store(0, torch.full((n,), slot), torch.arange(n), k=values)
    for start in (0, 3, 4, 13):
        got = cache.gather(0, "k", torch.tensor([2, 0]), 50, start)
        assert got.shape == (2, 50 - start, 1)
        assert torch.equal(got[0, :, 0], torch.arange(start, 50) + 200.0)
        if start < 7:
            assert torch.equal(got[1, : 7 - start, 0], torch.arange(start, 7).float())


def test_bench_engine_speculative_against_plain_decoding(tmp_path, capsys):
    """--speculative-algorithm: each decode batch with and without n-gram drafts in one run,
    the same tokens, and the acceptance length (contents, not timings); --json writes them
    (it wrote nothing under --speculative-algorithm before)."""
    argv = ["--hf-config", "configs/qwen3-moe-tiny.json", "--speculative-algorithm", "NGRAM"]
    flags = ["--decode-batches", "3", "--decode-prompt-len", "16", "--new-tokens", "12"]
    out = tmp_path / "spec.json"
    flags += ["--repeats", "1", "--threads", "1", "--json", str(out)]
    assert run_bench_engine([*argv, *flags]) == 0
    table = capsys.readouterr().out
    for column in ("plain tok/s", "spec tok/s", "speed-up", "accept len", "accepted", "3/3"):
        assert column in table
    [case] = json.loads(out.read_text())["cases"]
    assert (case["batch"], case["tokens"], case["same_tokens"]) == (3, 36, "3/3")
    assert case["speedup"] > 0 and case["acceptance_length"] >= 1
