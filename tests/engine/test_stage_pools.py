"""A rank's KV pool holds pages for the layers it runs, no others: its pipeline stage's
full-attention layers (a linear-attention layer keeps a state per sequence instead), and the
budget buys pages at what those layers take, so a stage of half the layers holds twice the
tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_overlap.core.engine_config import EngineSpec, kv_bytes_per_token
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig, pp_layers
from moe_overlap.distributed.groups import Group
from moe_overlap.model.caches import kv_cache_for
from moe_overlap.model.loader import build_model
from moe_overlap.model.tensor_parallel import ModelParallel
from tests.helpers import TINY

BUDGET = 2**20


def _pool_bytes(cfg: ModelConfig, spec: EngineSpec, layers: range | None = None) -> int:
    """What the pool of ``spec`` takes on the rank of ``layers``, every page grown."""
    par = ModelParallel(Group.single(name="attn_tp"), layers=layers)
    model = build_model(cfg, None, 0, par, mtp=spec.mtp_steps > 0)
    kv = kv_cache_for(model, spec.num_slots, spec.max_len, spec.page_size, spec.pool_pages)
    kv.allocate_all()
    return kv.allocated_bytes()


def test_a_hybrid_models_pool_holds_its_full_attention_layers_only():
    """Qwen3.5's tiny model: 3 of its 4 layers are linear attention. Their pages were grown
    beside the full layer's, 4x what the budget counted."""
    cfg = ModelConfig.from_hf("configs/qwen3_5-moe-tiny.json")
    assert sum(cfg.is_linear_layer(i) for i in range(cfg.num_hidden_layers)) == 3
    spec = EngineSpec(cfg, max_num_seqs=4, max_len=64, kv_cache_bytes=BUDGET)
    page = spec.page_size * spec.token_bytes
    assert _pool_bytes(cfg, spec) == (spec.pool_pages + 1) * page  # and the null page


@pytest.mark.parametrize(
    ("family", "pp", "mtp"),
    [("deepseek_v3", 2, 0), ("deepseek_v3", 3, 2), ("qwen3_moe", 2, 0)],
)
def test_each_pipeline_stage_budgets_and_holds_its_own_layers(family, pp, mtp):
    cfg = ModelConfig(**TINY[family])
    whole = EngineSpec(cfg, max_num_seqs=1024, max_len=64, kv_cache_bytes=BUDGET, mtp_steps=mtp)
    staged = dataclasses.replace(whole, parallel=ParallelConfig(pp=pp))
    stages = [pp_layers(cfg.num_hidden_layers, s, pp) for s in range(pp)]
    # the stage that takes the most bytes a token sets the pages every stage's pool has
    most = max(kv_bytes_per_token(cfg, 4, mtp=mtp > 0, stage=stage) for stage in stages)
    assert staged.token_bytes == most < whole.token_bytes
    assert staged.num_pages == BUDGET // (most * staged.page_size) > whole.num_pages
    for stage in stages:
        held = _pool_bytes(cfg, staged, stage)
        assert held <= BUDGET + most * staged.page_size  # the budget, and the null page
    # a stage that holds every layer's pages would take more than the budget
    assert _pool_bytes(cfg, staged) > BUDGET


def test_each_stage_holds_its_full_pages_and_sliding_windows_within_the_budget():
    """GPT-OSS's layers alternate sliding and full; six of them over two stages give one stage
    two sliding layers and the other two full ones. The full pages were bought at the most
    sliding bytes any stage has and the most bytes a token any stage has, which is no stage's
    split: the stage with more full layers grew past the budget (GPT-OSS-120B at --pp 4 on
    16 GiB: 19.8 GiB). Each stage now fits its own full pages and sliding windows, and the
    start-up line gives the largest stage's bytes."""
    hf = json.loads(Path("configs/gpt-oss-tiny.json").read_text())
    hf |= dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)
    cfg = ModelConfig.from_hf(hf)
    budget = 4 * 10**6
    spec = EngineSpec(cfg, max_num_seqs=8, max_len=1024, kv_cache_bytes=budget,
                      parallel=ParallelConfig(pp=2), sliding_budget=True)  # fmt: skip
    assert spec.window_budget is not None
    window = spec.window_budget[1]
    held = []
    for stage in (pp_layers(6, s, 2) for s in range(2)):
        model = build_model(cfg, None, 0, ModelParallel(Group.single(name="attn_tp"), layers=stage))
        kv = kv_cache_for(model, spec.num_slots, spec.max_len, spec.page_size, spec.pool_pages,
                          window_pages=window)  # fmt: skip
        kv.allocate_all()
        null = kv_bytes_per_token(cfg, stage=stage) * spec.page_size  # page 0 of each table
        held.append(kv.allocated_bytes() - null)
    assert max(held) <= budget
    assert f"{max(held) / 2**20:.2f} MiB of" in spec.kv_cache_summary()
