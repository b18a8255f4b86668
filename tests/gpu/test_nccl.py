"""Expert parallelism over NCCL, one rank per GPU: every overlap mode exact against the
one-process run without overlap, and the bench over the modelled link."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.tools.bench_cli import add_bench_commands
from tests.gpu.common import GPUS, needs_gpus
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap

pytestmark = needs_gpus
MODES = {name: mode_config(name) for name in ("none", "sbo", "tbo", "tbo+two-chunk")} | {
    "dbo": OverlapConfig("dbo", dbo_decode_token_threshold=1, dbo_prefill_token_threshold=1)
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_every_mode_on_nccl_matches_one_process(family):
    cfg = ModelConfig(**TINY[family])
    if cfg.num_experts % GPUS:
        pytest.skip(f"{cfg.num_experts} experts do not split over {GPUS} GPUs")
    with LLM(config=cfg, device="cuda", **KW) as llm:
        base = {c: llm.generate(p, PARAMS, return_logits=True) for c, p in CASES.items()}
    with LLM(config=cfg, device="cuda", ep=GPUS, **KW) as llm:
        for overlap in MODES.values():
            force_overlap(llm, overlap)
            for case, prompts in CASES.items():
                assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


def test_bench_over_the_modelled_link_on_gpus(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_commands(parser.add_subparsers())
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["bench", "--hf-config", "configs/qwen3-moe-bench.json", "--device", "cuda"]
        + ["--ep", str(GPUS), "--link", "model:10gbit,50us", "--repeat", "2"]
        + ["--workload", "uniform:256-2048:4096", "--modes", "none,sbo,tbo+two-chunk,dbo"]
        + ["--json", str(out)]
    )
    assert args.func(args) == 0
    assert out.exists() and json.loads(out.read_text())
