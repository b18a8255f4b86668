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
from moe_overlap.core.kv_cache import KVCache
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
    argv = ["--hf-config", "configs/qwen3-moe-tiny.json", "--compare-hf", *TINY_CASES]
    assert run_bench_engine([*argv, "--threads", "1", "--breakdown", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    names = ["prefill 1x24", "prefill 3x8", "decode batch 2", "decode batch 5"]
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
    assert [c["tokens"] for c in report["cases"]] == [24, 24, 6, 15]
    for case in report["cases"]:
        assert case["ours_tok_s"] > 0 and case["hf_tok_s"] > 0
        assert len(case["ours_times"]) == len(case["hf_times"]) == 1
        assert case["ours_s"] == min(case["ours_times"])
        assert case["ratio"] == pytest.approx(case["ours_tok_s"] / case["hf_tok_s"])
    # same weights and prompts: greedy tokens agree with transformers
    assert [c["same_tokens"] for c in report["cases"]] == ["1/1", "3/3", "2/2", "5/5"]


def test_bench_engine_alone_and_bad_flags(tmp_path, capsys):
    out = tmp_path / "engine.json"
    argv = ["--hf-config", "configs/qwen3-moe-tiny.json", *TINY_CASES, "--json", str(out)]
    assert run_bench_engine(argv) == 0
    assert all(c["ratio"] is None for c in json.loads(out.read_text())["cases"])
    with pytest.raises(SystemExit):
        run_bench_engine(["--hf-config", "x.json", "--prefill", "3072"])
    too_long = ["--hf-config", "configs/qwen3-moe-tiny.json", "--prefill", "1x5000"]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        run_bench_engine(too_long)


@pytest.mark.parametrize("make", [qwen3_hf_config, deepseek_hf_config])
def test_kv_bytes_per_token_matches_the_models_cache(make):
    cfg = ModelConfig.from_hf(make().to_dict())
    floats = sum(torch.Size(s).numel() for s in build_model(cfg).kv_entries().values())
    assert kv_bytes_per_token(cfg) == 4 * floats * cfg.num_hidden_layers


def test_kv_slots_bounded_by_the_budget():
    cfg = ModelConfig.from_hf("configs/qwen3-moe-bench.json")
    per_slot = kv_bytes_per_token(cfg) * 4096  # 4 layers x 2 x 4 heads x 64 x 4 bytes
    assert per_slot == 32 * 2**20
    spec = EngineSpec(cfg, max_len=4096, kv_cache_bytes=100 * per_slot)
    assert spec.max_num_seqs == DEFAULT_MAX_NUM_SEQS and spec.num_slots == 100
    assert "100 sequences (capped by the KV cache budget) x 4096 tokens" in spec.kv_cache_summary()
    assert EngineSpec(cfg, max_num_seqs=8, max_len=4096).num_slots == 8
    with pytest.raises(ConfigError, match="holds no sequence of max_len=4096"):
        EngineSpec(cfg, max_len=4096, kv_cache_bytes=per_slot - 1)


def test_kv_cache_grows_with_its_sequences():
    cache = KVCache(2, num_slots=256, max_len=4096, entries={"k": (2, 8)})
    assert cache.allocated_bytes() == 0
    k = torch.arange(3 * 16, dtype=torch.float32).view(3, 2, 8)
    cache.store(0, torch.tensor([1, 1, 1]), torch.tensor([0, 1, 2]), k=k)
    assert cache.allocated_bytes() == 2 * 64 * 2 * 8 * 4  # slots 0-1, 64 tokens, layer 0 only
    cache.store(0, torch.tensor([5]), torch.tensor([100]), k=k[:1])
    assert torch.equal(cache.gather(0, "k", slice(1, 2), 3)[0], k)  # kept across the growth
    padded = cache.gather(0, "k", torch.tensor([1, 5]), 101)
    assert padded.shape == (2, 101, 2, 8) and torch.equal(padded[1, 100], k[0])
    with pytest.raises(ValueError, match="exceeds the KV cache's max_len=4096"):
        cache.store(0, torch.tensor([0]), torch.tensor([4096]), k=k[:1])
    with pytest.raises(IndexError, match="slot 256 is outside"):
        cache.store(0, torch.tensor([256]), torch.tensor([0]), k=k[:1])
