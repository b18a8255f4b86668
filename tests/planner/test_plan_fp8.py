"""``plan --quantization fp8 --moe-dispatch-dtype fp8``: FP8 weights at the FP8 rate and half
the weight bytes, FP8 dispatch rows with their scales, the combine in BF16."""

from __future__ import annotations

import json

import pytest
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.planner.cluster import load_cluster
from moe_overlap.planner.costs import CostModel
from moe_overlap.planner.inputs import load_model_spec, make_layout, with_precision
from moe_overlap.planner.plan import Planner
from moe_overlap.planner.reproduce import CASES
from moe_overlap.tools.cli import main

QWEN = "configs/qwen3-30b-a3b.json"  # BF16 on the Hub; hidden 2048: 16 scales per row
PRECISIONS = {  # (--quantization, --moe-dispatch-dtype)
    "bf16": (None, "auto"),
    "fp8 weights": ("fp8", "auto"),
    "fp8 dispatch": (None, "fp8"),
    "fp8 both": ("fp8", "fp8"),
}


def prefill(tokens: int) -> ForwardBatch:
    return ForwardBatch(torch.zeros(tokens, dtype=torch.long), [0], [0], [tokens])


def test_fp8_dispatch_sends_a_byte_and_a_scale_per_128_and_the_combine_stays_bf16():
    spec, cluster = load_model_spec(QWEN), load_cluster("1x8-h100")
    layout = make_layout(None, None, 8, False, spec.cfg)
    plain = CostModel(spec, cluster, layout).micro_batch([prefill(512)] * 8)
    fp8 = CostModel(with_precision(spec, None, "fp8"), cluster, layout).micro_batch(
        [prefill(512)] * 8
    )
    assert plain.a2a_bytes == plain.combine_bytes == fp8.combine_bytes
    per_elem = 1 + 4 * 16 / 2048  # FP8 byte + a float32 scale per 128 of 2048 columns
    for got, bf16 in zip(fp8.a2a_bytes, plain.a2a_bytes, strict=True):
        assert got == pytest.approx([b * per_elem / 2 for b in bf16])
    assert (
        fp8.bytes_of("dispatch") is fp8.a2a_bytes and fp8.bytes_of("combine") is fp8.combine_bytes
    )
    # the weights' flag moves the GEMMs, not the bytes on the wire
    weights = CostModel(with_precision(spec, "fp8", "auto"), cluster, layout)
    assert weights.micro_batch([prefill(512)] * 8).a2a_bytes == plain.a2a_bytes
    assert weights.gemm == pytest.approx(1979 / 989 * CostModel(spec, cluster, layout).gemm)


def test_each_fp8_flag_makes_the_plan_faster_and_the_published_cases_ran_fp8():
    spec, cluster = load_model_spec(QWEN), load_cluster("1x8-h100")
    layout = make_layout(None, None, 8, False, spec.cfg)
    batches = [prefill(2048)] * 8
    seconds = {
        name: Planner(with_precision(spec, *flags), cluster, layout)
        .plan("none", mode_config("none"), batches)
        .seconds
        for name, flags in PRECISIONS.items()
    }
    assert seconds["fp8 both"] < min(seconds["fp8 weights"], seconds["fp8 dispatch"])
    assert max(seconds["fp8 weights"], seconds["fp8 dispatch"]) < seconds["bf16"]
    assert all(case.fp8 for case in CASES)  # DeepSeek-V3 with DeepGEMM and DeepEP's FP8


def test_plan_takes_both_flags_and_says_what_it_planned(tmp_path, capsys):
    argv = [
        "plan", "--hf-config", QWEN, "--cluster", "1x8-h100", "--ep", "8",
        "--workload", "single-long:1024", "--modes", "none,tbo",
    ]  # fmt: skip
    times = {}
    for name, extra in (
        ("bf16", []),
        ("fp8", ["--quantization", "fp8", "--moe-dispatch-dtype", "fp8"]),
    ):
        out = tmp_path / f"{name}.json"
        assert main([*argv, *extra, "--json", str(out)]) == 0
        times[name] = json.loads(out.read_text())["modes"]["none"]["median_s"]
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "BF16 weights, BF16 dispatch" in printed and "FP8 weights, FP8 dispatch" in printed
    assert times["fp8"] < times["bf16"]


def test_the_title_names_the_clusters_run_dtype(tmp_path, capsys):
    """A cluster of float32 rows (``--cluster this``: the engine's CPU dtype, 4 bytes per
    element) is titled FP32, not BF16; FP8 stays FP8 where asked."""
    cluster = load_cluster("1x8-h100").to_json() | {"name": "fp32", "activation_bytes": 4}
    path = tmp_path / "fp32.json"
    path.write_text(json.dumps(cluster))
    argv = ["plan", "--hf-config", QWEN, "--cluster", str(path), "--ep", "8",
            "--workload", "decode:8:128", "--modes", "none"]  # fmt: skip
    assert main(argv) == 0
    assert "FP32 weights, FP32 dispatch, FP32 combine" in capsys.readouterr().out.replace("\n", " ")
    assert main([*argv, "--moe-dispatch-dtype", "fp8"]) == 0
    assert "FP32 weights, FP8 dispatch, FP32 combine" in capsys.readouterr().out.replace("\n", " ")
