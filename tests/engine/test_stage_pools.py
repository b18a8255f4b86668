"""A rank's KV pool holds pages for the layers it runs, no others: its pipeline stage's
full-attention layers (a linear-attention layer keeps a state per sequence instead), and the
budget buys pages at what those layers take, so a stage of half the layers holds twice the
tokens."""

from __future__ import annotations

import dataclasses

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
