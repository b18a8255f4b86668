"""The strategy table: every scheme's schedule, built by one builder on each kind of layer."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.dbo import DualBatchOverlap
from moe_overlap.overlap.operations import Yield, execute_operations
from moe_overlap.overlap.sbo import CommLane, ExpertsThenCombine, SingleBatchOverlap, sbo_ops
from moe_overlap.overlap.strategy import (
    FAMILIES,
    STRATEGIES,
    SchemeOp,
    Strategy,
    build_operations,
    layer_operations,
    parse_ops,
    strategy_for,
)
from moe_overlap.runtime.model_runner import ModelRunner
from tests.helpers import TINY

ATTN = "prepare_attn attn_prepare attn_core prepare_mlp gate select_experts"


@pytest.fixture(scope="module")
def models():
    return {family: build_model(ModelConfig(**TINY[family]), seed=1) for family in TINY}


def names(ops) -> str:
    """An op list as text: yields as "|", ops by name (SBO's expert blocks by the table's)."""
    return " ".join(
        "|"
        if isinstance(op, Yield)
        else "experts_combine_a"
        if isinstance(op, ExpertsThenCombine)
        else op.__name__.removeprefix("op_")
        for op in ops
    )


def test_every_scheme_family_and_phase_has_an_entry():
    schemes, phases = ("none", "tbo", "sbo", "dbo"), ("prefill", "decode")
    own = {("tbo", "mimo_v2_flash", p) for p in phases}  # MiMo-V2-Flash's own TBO rows
    every = {(s, f, p) for s in schemes for f in FAMILIES for p in phases}
    assert set(STRATEGIES) == every | own
    assert STRATEGIES["tbo", "qwen3", "decode"].delta_stages == 2


def test_dbo_is_vllms_order_shared_experts_between_combine_send_and_receive(models):
    moe = models["deepseek_v3"].layers[1]
    assert names(layer_operations(moe, STRATEGIES["dbo", "deepseek", "prefill"])) == (
        f"{ATTN} dispatch_a | dispatch_b experts combine_a shared_experts | combine_b output"
    )


def test_sglang_tbo_orders(models):
    moe = models["deepseek_v3"].layers[1]
    assert names(layer_operations(moe, STRATEGIES["tbo", "deepseek", "prefill"])) == (
        f"{ATTN} dispatch_a | dispatch_b experts combine_a | shared_experts combine_b output"
    )
    assert names(layer_operations(moe, STRATEGIES["tbo", "deepseek", "decode"])) == (
        "prepare_attn attn_prepare | attn_core prepare_mlp gate select_experts | dispatch_a"
        " shared_experts | dispatch_b experts combine_a | combine_b | output"
    )


@pytest.mark.parametrize("scheme", ["none", "tbo", "sbo", "dbo"])
def test_layers_without_shared_experts_skip_them_and_dense_layers_never_yield(models, scheme):
    qwen3, deepseek = models["qwen3_moe"], models["deepseek_v3"]
    own = sbo_ops(2, CommLane(3, torch.device("cpu")))
    for phase in ("prefill", "decode"):
        strategy = STRATEGIES[scheme, "qwen3", phase]
        got = names(layer_operations(qwen3.layers[0], strategy, own))
        assert "shared_experts" not in got
        assert got == " ".join(n for n in strategy.moe_ops if n != "shared_experts")
        dense = deepseek.layers[0]
        assert not dense.is_moe
        got = names(layer_operations(dense, strategy))
        assert got == "prepare_attn attn_prepare attn_core prepare_mlp dense_mlp output"


def test_sbo_brings_its_own_ops_by_name(models):
    scheme = SingleBatchOverlap(models["deepseek_v3"], OverlapConfig("sbo"), Group.single())
    own = [op for op in scheme.ops if isinstance(op, ExpertsThenCombine)]
    assert [op.layer_id for op in own] == [1, 2]  # one per MoE layer, none on the dense one
    dense = "prepare_attn attn_prepare attn_core prepare_mlp dense_mlp output"
    moe = f"{ATTN} dispatch_a shared_experts dispatch_b experts_combine_a combine_b output"
    assert names(scheme.ops) == f"embed {dense} {moe} {moe} logits"


def test_every_scheme_builds_the_same_forward(models):
    """The plain entry, and each scheme's ops run in one go, give the same logits."""
    batch = ForwardBatch(torch.arange(20) % 80, [0, 1], [0, 0], [8, 12], [True, True])
    for family, model in models.items():
        runner = ModelRunner(model, LocalDispatcher(model.cfg.num_experts), 4, 64)
        dbo = DualBatchOverlap(model, OverlapConfig("dbo"), Group.single())
        schemes = {
            "tbo decode": build_operations(model, strategy_for(model, "tbo", decode=True)),
            "dbo": dbo.ops,
            "sbo": SingleBatchOverlap(model, OverlapConfig("sbo"), Group.single()).ops,
        }
        dbo.close()
        with torch.inference_mode():
            plain = build_operations(model, strategy_for(model, "none"))
            want = execute_operations(runner.context(batch), plain)["logits"]
            for scheme, ops in schemes.items():
                got = execute_operations(runner.context(batch), ops)["logits"]
                assert torch.equal(got, want), (family, scheme)


def test_strategies_that_do_not_cover_the_layer_are_refused(models):
    moe = models["deepseek_v3"].layers[1]
    missing = Strategy("no-experts", parse_ops(f"{ATTN} dispatch_a dispatch_b combine_a output"))
    with pytest.raises(ValueError, match="strategy no-experts covers ops .* but layer 1 has"):
        layer_operations(moe, missing)
    unknown = Strategy("own", parse_ops(f"{ATTN} dispatch_a shared_experts dispatch_b mine"))
    with pytest.raises(ValueError, match="strategy own covers"):
        layer_operations(moe, unknown, {"mine": SchemeOp(("experts",), lambda layer: None)})
    with pytest.raises(ValueError, match="dense layers do not yield"):
        Strategy("x", (), dense_ops=("prepare_attn", "|", "output"))
    with pytest.raises(ValueError, match="delta_stages must be >= 0"):
        Strategy("x", (), delta_stages=-1)


def test_a_users_strategy_overrides_by_model_type_or_family(models):
    model = models["qwen3_moe"]
    mine = Strategy("mine", STRATEGIES["none", "qwen3", "prefill"].moe_ops)
    assert strategy_for(model, "tbo", False, {("tbo", "qwen3_moe", "prefill"): mine}) is mine
    assert strategy_for(model, "tbo", False, {("tbo", "qwen3", "prefill"): mine}) is mine
    assert strategy_for(model, "tbo", True, {("tbo", "qwen3", "prefill"): mine}).name == (
        "tbo-decode"
    )
    with pytest.raises(KeyError, match="no fast strategy for qwen3_moe prefill"):
        strategy_for(model, "fast")
