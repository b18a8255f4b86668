"""Bad values and flag files on the command line: one error line naming the flag, or the
value taken as written; each found by trying the commands as a user would."""

from __future__ import annotations

from moe_overlap.tools.cli import main

CONFIG = "configs/qwen3-moe-tiny.json"


def test_plan_cluster_this_refuses_repeat_0_naming_it_before_measuring(capsys):
    """``--repeat 0`` measured the machine, then failed with statistics' 'no median for
    empty data', naming no flag."""
    argv = ["plan", "--hf-config", CONFIG, "--cluster", "this", "--repeat", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--repeat=0 must be >= 1" in err and "median" not in err
