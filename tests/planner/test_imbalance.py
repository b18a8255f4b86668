"""Expert imbalance in the plan: the balancedness a plan times each MoE layer at (its busiest
rank's rows and bytes), EPLB's from our placement code, and ``plan``'s flags."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.eplb_placement import PlacementShape
from moe_overlap.core.errors import ConfigError
from moe_overlap.planner.cluster import load_cluster
from moe_overlap.planner.costs import CostModel
from moe_overlap.planner.imbalance import eplb_imbalance, plan_imbalance
from moe_overlap.planner.inputs import load_model_spec, make_layout
from moe_overlap.tools.cli import main
from tests.planner.test_planner_gpu import decode

V3 = load_model_spec("configs/deepseek-v3.json")


def test_balancedness_before_and_after_eplb():
    shape = PlacementShape(8, 12, 4)
    load = [[900, 50, 40, 30, 20, 10, 5, 5], [5, 5, 10, 20, 30, 40, 50, 900]]
    plain = plan_imbalance(shape, load=load)
    placed = plan_imbalance(shape, load=load, eplb=True)
    assert plain.before == plain.planned == placed.before < 0.5 and not plain.eplb
    assert placed.planned > 0.8 and placed.factor == pytest.approx(1 / placed.planned)
    # a balancedness alone: a synthetic load that uneven; more redundant slots balance better
    asked = plan_imbalance(PlacementShape(256, 256, 32, 4, 8), 0.5)
    assert asked.planned == asked.before == 0.5 and asked.factor == 2
    fewer = eplb_imbalance(PlacementShape(256, 256, 32, 4, 8), 0.5)
    more = eplb_imbalance(PlacementShape(256, 288, 32, 4, 8), 0.5)
    assert 0.5 < fewer.planned < more.planned <= 1
    with pytest.raises(ConfigError, match="balancedness=1.5"):
        plan_imbalance(shape, 1.5)
    with pytest.raises(ConfigError, match="want 8 loads per layer"):
        plan_imbalance(shape, load=[[1, 2]])


def test_the_busiest_rank_sets_expert_time_and_bytes():
    layout = make_layout(8, 8, 8, True, V3.cfg)
    cluster = load_cluster("1x8-h100")
    hot = dataclasses.replace(cluster, expert_imbalance=2.0)
    prefill = ForwardBatch(torch.zeros(4096, dtype=torch.long), [0], [0], [4096])
    for batch in (prefill, decode(128, 2000)):
        even = CostModel(V3, cluster, layout).micro_batch([batch] * 8)
        skewed = CostModel(V3, hot, layout).micro_batch([batch] * 8)
        assert sum(skewed.a2a_bytes[0]) == pytest.approx(2 * sum(even.a2a_bytes[0]))
        assert skewed.seconds["attn_core"] == even.seconds["attn_core"]  # not routed
        ratio = skewed.seconds["experts"][0] / even.seconds["experts"][0]
        # prefill's experts compute twice the rows; decode's read their weights either way
        assert ratio > 1.8 if batch is prefill else 1 < ratio < 1.2


def test_plan_flags(tmp_path, capsys):
    argv = ["plan", "--hf-config", "configs/deepseek-v3.json", "--cluster", "1x8-h100"]
    argv += ["--ep", "8", "--workload", "decode:64:1000", "--modes", "none"]
    assert main([*argv, "--balancedness", "0.5"]) == 0
    assert "expert balancedness 0.500" in capsys.readouterr().out
    dist = tmp_path / "load.json"  # the recorder's dump has the same "load"
    dist.write_text(json.dumps({"load": [[1000 // (e + 1) for e in range(256)]] * 2}))
    assert main([*argv, "--expert-distribution", str(dist), "--enable-eplb"]) == 0
    assert "after EPLB" in capsys.readouterr().out
    assert main([*argv, "--enable-eplb"]) == 2
    assert "need the routing to balance" in capsys.readouterr().err
    assert main([*argv, "--balancedness", "0.5", "--expert-distribution", str(dist)]) == 2
    assert "not both" in capsys.readouterr().err


def test_redundant_slots_need_ep_to_divide_experts_and_slots_together(capsys):
    # DeepSeek-V3's 256 experts over the blog's EP72: with R = 32, 288 slots, 4 per GPU
    assert make_layout(72, 72, 72, True, V3.cfg, 32).slots_per_gpu(V3.cfg) == 4
    with pytest.raises(ConfigError, match="--ep=72 must divide num_experts=256; .* redundant"):
        make_layout(72, 72, 72, True, V3.cfg)
    with pytest.raises(ConfigError, match=r"= 272 physical expert slots; choose .* 32 \(or"):
        make_layout(72, 72, 72, True, V3.cfg, 16)
    # each GPU reads every slot's weights: replicas cost decode's expert time
    cluster, batch = load_cluster("1x8-h100"), decode(128, 2000)
    experts = [
        CostModel(V3, cluster, make_layout(8, 8, 8, True, V3.cfg, r)).micro_batch([batch] * 8)
        for r in (0, 32)
    ]
    assert experts[1].seconds["experts"][0] > experts[0].seconds["experts"][0]
    argv = ["plan", "--hf-config", "configs/qwen3-30b-a3b.json", "--cluster", "1x8-h100"]
    argv += ["--ep", "6", "--workload", "decode:64:1000", "--modes", "none"]
    assert main([*argv, "--ep-num-redundant-experts", "4", "--balancedness", "0.6"]) == 0
    assert "expert balancedness 0.600 -> " in capsys.readouterr().out  # 128 + 4 over 6
    assert main([*argv, "--ep-num-redundant-experts", "2", "--balancedness", "0.6"]) == 2
    assert "128 + --ep-num-redundant-experts=2 = 130" in capsys.readouterr().err
