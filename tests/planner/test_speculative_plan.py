"""``plan --speculative-num-draft-tokens K --accept-length A``: the verify forward's K rows a
sequence through the engine's own decisions, the draft's cost, the predicted speed-up and
whether TBO pays on verify."""

from __future__ import annotations

import re

import pytest

from moe_overlap.core.batch import ForwardMode
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.workloads import make_batches, parse_workload
from moe_overlap.planner.cluster import load_cluster
from moe_overlap.planner.inputs import load_model_spec, make_layout
from moe_overlap.planner.plan import Planner
from moe_overlap.planner.speculative import (
    Speculation,
    one_layer,
    plan_speculation,
    speculation_inputs,
    speculative_workload,
    verify_batch,
)
from moe_overlap.tools.cli import main

QWEN = "configs/qwen3-30b-a3b.json"


def test_plan_prints_the_speedup_and_whether_tbo_pays_on_verify(capsys):
    argv = [
        "plan", "--hf-config", QWEN, "--cluster", "1x8-h100", "--ep", "8", "--modes", "none,tbo",
        "--speculative-num-draft-tokens", "3", "--accept-length", "2.4",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "workload decode:64:4096" in printed  # the default prefill workload is replaced
    assert "x predicted" in printed and "tbo on the verify forward:" in printed
    assert re.search(r"x over none, (pays|does not pay) \(on plain decode: [\d.]+x\)", printed)


def test_verify_cost_draft_cost_and_acceptance_move_the_prediction():
    spec = load_model_spec(QWEN)
    layout = make_layout(None, None, 8, False, spec.cfg)
    planner = Planner(spec, load_cluster("1x8-h100"), layout)
    workload = parse_workload("decode:32:2048", layout.dp_groups)
    batches = make_batches(workload, 1, 0)
    verify = verify_batch(batches[0], 4)
    assert verify.mode == ForwardMode.TARGET_VERIFY and verify.num_tokens == 4 * 32
    configs = {m: mode_config(m) for m in ("none", "tbo")}

    def plans(rows: int, accept: float, drafter: str = "ngram"):
        return plan_speculation(
            planner, configs, batches, layout, Speculation(rows, accept, drafter)
        )

    ngram, mtp, useless = plans(4, 2.5), plans(4, 2.5, "mtp"), plans(4, 1.0)
    none = ngram["none"]
    assert none.seqs == 8 * 32 and none.draft_s == 0.0
    assert none.verify.seconds > none.decode.seconds  # four rows a sequence cost more than one
    assert none.spec_tokens_per_s == pytest.approx(256 * 2.5 / none.verify.seconds)
    assert 0 < mtp["none"].draft_s < none.decode.seconds  # three steps of one layer of 48
    assert mtp["none"].spec_tokens_per_s < none.spec_tokens_per_s
    assert useless["none"].spec_tokens_per_s < none.plain_tokens_per_s  # no draft accepted
    # the verify batch carries K times the tokens: TBO's ratio over none moves toward paying
    tbo = ngram["tbo"]
    on_verify = none.verify.seconds / tbo.verify.seconds
    assert on_verify > none.decode.seconds / tbo.decode.seconds


def test_the_mtp_draft_is_planned_as_the_families_mtp_layer():
    """DeepSeek-style MTP layers are full attention with the MoE; MiMo-V2-Flash's a sliding
    window with a dense MLP."""
    qwen = one_layer(load_model_spec(QWEN).cfg)
    mimo = one_layer(load_model_spec("configs/mimo-v2-flash-tiny.json").cfg)
    assert qwen.is_moe_layer(0) and not qwen.window(0)
    assert not mimo.is_moe_layer(0) and mimo.window(0) == mimo.sliding_window


@pytest.mark.parametrize(
    ("rows", "accept", "drafter", "match"),
    [
        (None, 2.0, "ngram", "needs --speculative-num-draft-tokens"),
        (3, None, "ngram", "needs --accept-length"),
        (1, 1.0, "ngram", "must be an integer >= 2"),
        (3, 3.5, "ngram", "between 1 and K=3"),
        (3, 2.0, "eagle", "must be one of"),
    ],
)
def test_bad_speculation_flags_are_refused(rows, accept, drafter, match):
    with pytest.raises(ConfigError, match=match):
        speculation_inputs(rows, accept, drafter)


def test_speculation_needs_a_decode_workload():
    assert speculation_inputs(None, None, "ngram") is None
    assert speculative_workload("uniform:30-3072", False) == ("uniform:30-3072", None)
    assert speculative_workload("decode:8:100", True) == ("decode:8:100", None)
    with pytest.raises(ConfigError, match="give --workload decode:BS:CTX"):
        speculative_workload("single-long:100", True)
