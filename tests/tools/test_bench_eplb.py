"""``bench --eplb-compare R``: skewed routing on the trivial placement, then EPLB's placement of
what was recorded there, without and with R redundant experts, in one run."""

from __future__ import annotations

import json

from moe_overlap.tools.cli import main


def test_eplb_compare_balances_the_recorded_routing(tmp_path, capsys):
    out = tmp_path / "eplb.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--ep", "2"]
    argv += ["--expert-skew", "zipf:2", "--ep-dispatch-algorithm", "dynamic", "--modes", "none"]
    argv += ["--workload", "uniform:4-12:48", "--repeat", "1", "--eplb-compare", "2"]
    assert main([*argv, "--json", str(out), "--trace", str(tmp_path / "t.json")]) == 0
    printed = capsys.readouterr().out
    said = " ".join(printed.split())  # the console wraps long lines
    assert "(the trivial placement's run; --json holds every run)" in said  # the trace's
    assert "eplb+2 redundant" in printed and "vs trivial" in printed
    runs = json.loads(out.read_text())
    assert list(runs) == ["trivial", "eplb", "eplb+2 redundant"]
    mean = {name: sum(r["balancedness"]) / len(r["balancedness"]) for name, r in runs.items()}
    assert mean["trivial"] < mean["eplb"] <= mean["eplb+2 redundant"]
    assert all(r["modes"]["none"] > 0 for r in runs.values())
    assert main([*argv, "--ep-num-redundant-experts", "2"]) == 2  # it places the experts itself
    assert "places the experts itself" in capsys.readouterr().err
