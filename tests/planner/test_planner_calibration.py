"""The `this` calibration's new parts: its saved measurements, the per-expert, DBO hand-over and
routing costs it fits, and `plan --compare-bench`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.planner.calibration import bytes_factor, fit_cluster
from moe_overlap.planner.inputs import load_model_spec, make_layout
from moe_overlap.planner.measurements import (
    PAIRS,
    TWO_PASSES,
    PassSample,
    Sample,
    calibration_batches,
    decode_batch,
    expert_shares,
    imbalance,
    measurements_from_json,
    measurements_json,
)
from moe_overlap.planner.plan import Planner
from moe_overlap.tools.cli import main
from tests.planner.test_plan import FLAT

CONFIG = "configs/qwen3-moe-bench.json"
SPEC = load_model_spec(CONFIG)
LAYOUT = make_layout(None, None, 2, False)
ABOUT = {"config": "qwen3-moe-bench", "ep": 2, "world": 2, "link": "model:300mbit,50us"}
TRUTH = dataclasses.replace(
    FLAT, gemm_tflops_bf16=0.05, attention_tflops=0.02, intra_node_a2a_gbps=0.375,
    inter_node_a2a_gbps=0.375, a2a_latency_us=100.0, op_overhead_us=300.0,
    expert_overhead_us=400.0, switch_overhead_us=200.0, a2a_bytes_factor=1.25,
    hbm_gbps=1e15, forward_overhead_us=5000.0, attention_full_rectangle_with_prefix=True,
    overheads_beyond_first=True,
)  # fmt: skip


def measured_by(cluster) -> tuple[list[Sample], list[PassSample]]:
    """What a machine that is exactly ``cluster`` would measure."""
    p = Planner(SPEC, cluster, LAYOUT)
    samples = []
    for b in calibration_batches(SPEC.cfg.vocab_size):
        plan = p.plan("none", mode_config("none"), [b] * 2, record=True)
        spans = [s for s in plan.spans[0] if s.track == "comm"]  # "... 0.52 MB"
        transfers = tuple((float(s.name.split()[-2]) * 1e6, s.end - s.start) for s in spans)
        samples.append(Sample(b, plan.seconds, plan.t_comm, transfers, routed(cluster, b)))
    passes = []
    for mode, shape in PAIRS:
        pair = [decode_batch(*shape)] * 2
        none = p.plan("none", mode_config("none"), pair).seconds
        passes.append(PassSample(pair[0], none, p.plan(mode, TWO_PASSES[mode], pair).seconds, mode))
    return samples, passes


def routed(cluster, batch) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per layer (4), per rank, the bytes the engine's dispatch would send off it and receive,
    every rank running ``batch``: a rank's experts get their share of every rank's rows."""
    rows = SPEC.cfg.num_experts_per_tok * batch.num_tokens * SPEC.cfg.hidden_size * 4
    shares = cluster.expert_shares or (0.5, 0.5)
    return (tuple((rows * (1 - p), rows * p) for p in shares),) * 4


def test_saved_measurements_fit_the_same_cluster_and_refuse_another_setup() -> None:
    samples, passes = measured_by(TRUTH)
    raw = json.loads(json.dumps(measurements_json(samples, passes, ABOUT)))
    again = measurements_from_json(raw, SPEC.cfg.vocab_size, ABOUT)
    fitted = fit_cluster(SPEC, LAYOUT, samples, passes)
    refitted = fit_cluster(SPEC, LAYOUT, *again)
    for name in ("expert_overhead_us", "switch_overhead_us", "op_overhead_us", "a2a_bytes_factor",
                 "gemm_tflops_bf16", "forward_overhead_us"):  # fmt: skip
        # DBO's hand-overs are a small part of its pair (spans name bytes to 0.01 MB only)
        rel = 0.1 if name == "switch_overhead_us" else 0.05
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=rel), name
        assert getattr(refitted, name) == pytest.approx(getattr(fitted, name), rel=1e-6), name
    with pytest.raises(
        ConfigError, match="link='model:300mbit,50us', this plan has 'model:1gbit,50us'"
    ):
        measurements_from_json(raw, SPEC.cfg.vocab_size, ABOUT | {"link": "model:1gbit,50us"})
    with pytest.raises(ConfigError, match="holds 2 shapes"):
        measurements_from_json(raw | {"samples": raw["samples"][:2]}, 1024, ABOUT)
    for broken, says in (
        ([1, 2], "no measurements object"),
        (raw | {"samples": 7}, "holds no list of shapes"),
        (raw | {"passes": [["tbo", 2, 16, "fast", 0.1]]}, "malformed measurements"),
        (raw | {"passes": [["sbo", 2, 16, 0.1, 0.1]]}, "pair mode 'sbo'"),
    ):
        with pytest.raises(ConfigError, match=says):
            measurements_from_json(broken, SPEC.cfg.vocab_size, ABOUT)


def test_routing_imbalance_is_the_bytes_over_even_routing() -> None:
    samples, _ = measured_by(TRUTH)
    assert bytes_factor(SPEC, LAYOUT, samples, ()) == pytest.approx(1.25, rel=0.02)
    even = Planner(SPEC, dataclasses.replace(TRUTH, a2a_bytes_factor=1.0), LAYOUT)
    skewed = Planner(SPEC, TRUTH, LAYOUT)
    b = [decode_batch(64, 16)] * 2
    assert skewed.costs.micro_batch(b).a2a_bytes[0][0] == pytest.approx(
        1.25 * even.costs.micro_batch(b).a2a_bytes[0][0]
    )


def test_calibration_learns_which_ranks_experts_the_router_favours() -> None:
    """Rank 0's experts get 60% of the rows: the fit finds that from the bytes each rank's
    dispatches sent and received, and an uneven split's bytes follow it. With rank 0 holding
    more tokens, fewer rows cross than even routing times a factor says."""
    hot = dataclasses.replace(
        TRUTH, a2a_bytes_factor=1.0, expert_shares=[0.6, 0.4], expert_imbalance=1.2
    )
    samples, passes = measured_by(hot)
    assert expert_shares(SPEC, samples, 2) == pytest.approx((0.6, 0.4))
    fitted = fit_cluster(SPEC, LAYOUT, samples, passes)
    assert fitted.expert_shares == pytest.approx((0.6, 0.4))
    assert fitted.a2a_bytes_factor == pytest.approx(1.0, rel=0.02)
    # rank 0's experts hold 1.2x the mean rows, and the rates come out as the machine's
    assert fitted.expert_imbalance == pytest.approx(1.2, rel=0.01)
    assert fitted.gemm_tflops_bf16 == pytest.approx(hot.gemm_tflops_bf16, rel=0.05)
    k, row = SPEC.cfg.num_experts_per_tok, SPEC.cfg.hidden_size * hot.activation_bytes
    uneven = [decode_batch(48, 16), decode_batch(16, 16)]  # 48 tokens on rank 0, 16 on rank 1
    crossing = max(48 * k * 0.4, 16 * k * 0.6) * row  # rank 0 sends 40%, rank 1 sends 60%
    by_rank = Planner(SPEC, fitted, LAYOUT).costs.micro_batch(uneven).a2a_bytes
    assert [sum(b) for b in by_rank] == pytest.approx([crossing, crossing], rel=0.01)
    with pytest.raises(ConfigError, match="must hold 2 or more shares that sum to 1"):
        dataclasses.replace(hot, expert_shares=[0.7, 0.7])
    with pytest.raises(ConfigError, match="3 expert_shares for a layout of 2 ranks"):
        Planner(SPEC, dataclasses.replace(hot, expert_shares=[0.5, 0.25, 0.25]), LAYOUT)


def test_the_busiest_rank_of_each_layer_sets_the_imbalance() -> None:
    """The hot rank changes from layer to layer: over the forward the ranks' shares look even,
    yet every layer waited for a rank with 1.2x the mean rows. A file saved before the labels
    named each layer holds the sums, one entry."""
    batch = calibration_batches(SPEC.cfg.vocab_size)[8]  # 2048 tokens: 8.39 MB per layer
    own = SPEC.cfg.num_experts_per_tok * batch.num_tokens * SPEC.cfg.hidden_size * 4
    hot0 = ((0.4 * own, 0.6 * own), (0.6 * own, 0.4 * own))  # (sent, received) per rank
    hot1 = hot0[::-1]
    flips = Sample(batch, 1.0, 0.1, (), (hot0, hot1, hot0, hot1))
    assert expert_shares(SPEC, [flips], 2) == pytest.approx((0.5, 0.5))
    assert imbalance(SPEC, flips) == pytest.approx(1.2)
    same = Sample(batch, 1.0, 0.1, (), (hot0,) * 4)
    saved = measurements_json([same], [], ABOUT)["samples"][0]
    summed = [*saved[:3], [[4 * a for a in rank] for rank in hot0]]  # the older file's form
    raw = json.loads(json.dumps(measurements_json(*measured_by(TRUTH), ABOUT)))
    raw["samples"][8] = summed
    old = measurements_from_json(raw, SPEC.cfg.vocab_size, ABOUT)[0][8]
    assert len(old.routed) == 1 and imbalance(SPEC, old) == pytest.approx(1.2)
    tiny = Sample(decode_batch(2, 16), 1.0, 0.1, (), (((0.0, 0.01e6), (0.01e6, 0.0)),) * 4)
    assert imbalance(SPEC, tiny) is None  # 4 rows: labels in 0.01 MB cannot tell
    with pytest.raises(ConfigError, match="expert_imbalance=0.9 must be a number >= 1"):
        dataclasses.replace(TRUTH, expert_imbalance=0.9)


def test_each_micro_batch_pays_its_experts_and_dbo_its_hand_overs() -> None:
    fast_link = dataclasses.replace(TRUTH, intra_node_a2a_gbps=1e6, inter_node_a2a_gbps=1e6)
    batches = [decode_batch(64, 16)] * 2

    def extra(cluster, mode: str) -> float:
        p = Planner(SPEC, cluster, LAYOUT)
        return (
            p.plan(mode, TWO_PASSES[mode], batches).seconds
            - p.plan("none", mode_config("none"), batches).seconds
        )

    base = dataclasses.replace(fast_link, expert_overhead_us=0.0, switch_overhead_us=0.0)
    with_experts = dataclasses.replace(base, expert_overhead_us=1000.0)
    # 4 layers, every one of a rank's 4 experts active in both halves of 64 sequences (and
    # already in none): the second micro-batch runs each expert once more, 16 x 1 ms
    assert extra(with_experts, "tbo") - extra(base, "tbo") == pytest.approx(0.016, rel=0.05)
    with_switch = dataclasses.replace(base, switch_overhead_us=1000.0)
    stages = sum(1 for op in Planner(SPEC, base, LAYOUT).ops("dbo") if repr(op) == "YIELD")
    # the second thread's turns: the first micro-batch's costs are in the fitted rates
    assert extra(with_switch, "dbo") - extra(base, "dbo") == pytest.approx(stages * 1e-3)
    assert extra(with_switch, "tbo") == pytest.approx(extra(base, "tbo"))  # DBO's threads only
    none = mode_config("none")
    for cluster in (with_experts, with_switch):  # no second micro-batch, none of these costs
        assert Planner(SPEC, cluster, LAYOUT).plan("none", none, batches).seconds == pytest.approx(
            Planner(SPEC, base, LAYOUT).plan("none", none, batches).seconds
        )


def bench_json(path, workload: str, medians: dict[str, float]) -> str:
    modes = {
        m: {"median_s": s, "times_s": [s * 0.9, s, s * 1.2], "speedup": medians["none"] / s}
        for m, s in medians.items()
    }
    path.write_text(json.dumps({"workload": workload, "modes": modes}))
    return str(path)


def test_compare_bench_prints_each_modes_error(tmp_path, capsys) -> None:
    argv = ["plan", "--hf-config", CONFIG, "--cluster", "1x8-h100", "--ep", "2",
            "--workload", "decode:64:512", "--modes", "none,tbo",
            "--json", str(tmp_path / "plan.json")]  # fmt: skip
    assert main(argv) == 0
    planned = json.loads((tmp_path / "plan.json").read_text())["modes"]
    bench = bench_json(tmp_path / "b.json", "decode:64:512", {"none": 0.01, "tbo": 0.02, "dbo": 1})
    capsys.readouterr()
    assert main([*argv, "--compare-bench", bench]) == 0
    out = capsys.readouterr().out.split("plan vs bench")[1]
    for mode, measured in (("none", 0.01), ("tbo", 0.02)):
        row = next(line for line in out.splitlines() if f" {mode} " in line)
        error = (planned[mode]["median_s"] - measured) / measured
        assert f"{error:+.1%}" in row and f"{measured * 1e3:.1f}" in row
    assert " dbo " not in out  # benched but not planned: left out
    wrong = bench_json(tmp_path / "w.json", "single-long:3072", {"none": 1.0})
    assert main([*argv, "--compare-bench", wrong]) != 0
    assert "bench ran workload 'single-long:3072'" in capsys.readouterr().err
    assert main([*argv, "--compare-bench", str(tmp_path / "plan.json")]) != 0
    assert "that file is a plan" in capsys.readouterr().err
    same = json.loads(Path(bench).read_text()) | {"ep": 2, "tokens_per_forward": 128}
    Path(bench).write_text(json.dumps(same))
    assert main([*argv, "--compare-bench", bench]) == 0  # EP 2: two groups of 64 sequences
    capsys.readouterr()
    for key, value, says in (("ep", 4, "the bench's EP: 4, the plan's: 2"),
                             ("tokens_per_forward", 256, "tokens per forward: 256, the plan's: 128")):  # fmt: skip
        Path(bench).write_text(json.dumps(same | {key: value}))
        assert main([*argv, "--compare-bench", bench]) != 0  # a bench of another layout
        assert says in capsys.readouterr().err
    (tmp_path / "text.json").write_text("median 0.01")
    bad_median = bench_json(tmp_path / "m.json", "decode:64:512", {"none": 0.01, "tbo": -1.0})
    for path, says in (
        (tmp_path / "missing.json", "cannot read it"),
        (tmp_path / "text.json", "not JSON"),
        (bad_median, "mode 'tbo' needs a positive median_s"),
    ):
        assert main([*argv, "--compare-bench", str(path)]) != 0
        assert says in capsys.readouterr().err


def test_both_ranks_links_carry_the_larger_direction_as_the_engine_sends() -> None:
    """EP 2, ranks of 300 and 100 tokens: each rank's link carries max(sent, received) rows
    off-rank, 300 x top-2 / 2 on both (the engine's ``off_rank``), not an average."""
    even = dataclasses.replace(TRUTH, a2a_bytes_factor=1.0)
    costs = Planner(SPEC, even, LAYOUT).costs.micro_batch(
        [decode_batch(300, 8), decode_batch(100, 8)]
    )
    row = SPEC.cfg.hidden_size * even.activation_bytes
    assert [sum(b) for b in costs.a2a_bytes] == pytest.approx([300 * row, 300 * row])
