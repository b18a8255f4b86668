"""``moe-overlap eplb-placement``: a load file in, a placement file out, the table printed."""

from __future__ import annotations

import json

import pytest

from moe_overlap.core.eplb_placement import PlacementShape, balancedness, trivial
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import check_placement, initial_placement
from moe_overlap.tools.cli import main

LOAD = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]


def test_placement_file_and_table(tmp_path, capsys):
    dist, out = tmp_path / "load.json", tmp_path / "placement.json"
    dist.write_text(json.dumps({"load": LOAD}))
    argv = ["eplb-placement", "--distribution", str(dist), "--ep", "8"]
    argv += ["--num-redundant-experts", "4", "--nodes", "2", "--num-groups", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "deepseek_hierarchical" in printed and "0.480" in printed  # layer 0's trivial
    placement = json.loads(out.read_text())["physical_to_logical"]
    shape = PlacementShape(12, 16, 8, 2, 4)
    check_placement(placement, shape, "out")
    for row, load in zip(placement, LOAD, strict=True):
        assert balancedness(row, load, 8) > balancedness(trivial(shape), load, 8)
    # --init-expert-location takes the placement and the distribution alike
    assert initial_placement(str(out), shape, 2) == placement
    assert initial_placement(str(dist), shape, 2) == placement
    with pytest.raises(ConfigError, match="3 MoE layers"):
        initial_placement(str(out), shape, 3)


def test_bad_inputs_are_named(tmp_path):
    dist = tmp_path / "load.json"
    dist.write_text(json.dumps({"load": [[1, 2, 3], [1, 2]]}))
    argv = ["eplb-placement", "--distribution", str(dist), "--ep", "3", "--out", "x.json"]
    assert main(argv) != 0
    dist.write_text(json.dumps({"weights": []}))
    with pytest.raises(ConfigError, match="load"):
        initial_placement(str(dist), PlacementShape(3, 3, 3), 1)
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"physical_to_logical": [[0, 0, 1, 2]]}))
    with pytest.raises(ConfigError, match="two replicas of one expert on rank 0"):
        initial_placement(str(bad), PlacementShape(3, 4, 2), 1)


def test_a_distribution_with_no_layers_is_refused_by_every_reader(tmp_path, capsys):
    """``{"load": []}`` is an error naming the file in eplb-placement and plan, not an
    IndexError or a ZeroDivisionError traceback."""
    dist = tmp_path / "empty.json"
    dist.write_text(json.dumps({"load": []}))
    plan = ["plan", "--hf-config", "configs/qwen3-30b-a3b.json", "--cluster", "1x8-h100"]
    for argv in (
        ["eplb-placement", "--distribution", str(dist), "--out", str(tmp_path / "p.json")],
        [*plan, "--ep", "8", "--workload", "decode:8:128", "--expert-distribution", str(dist)],
    ):
        assert main(argv) == 2
        assert f"EPLB file {dist}: want {{'load'" in capsys.readouterr().err
