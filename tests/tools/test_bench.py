"""The benchmark: workloads, and one end-to-end run writing JSON, a Chrome trace and a PNG."""

from __future__ import annotations

import json

import pytest

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.workloads import WorkloadError, check_fits, parse_workload
from moe_overlap.tools.cli import main
from moe_overlap.tools.cli_args import bench_engine_kwargs
from moe_overlap.tools.commands import build_parser


def test_workloads_parse_and_seeds_reproduce():
    assert parse_workload("single-long", 2).lengths == [[3072], [3072]]
    assert parse_workload("single-long:100", 1).lengths == [[100]]
    a, b = (
        parse_workload("uniform:30-300:1000", 2, seed=4),
        parse_workload("uniform:30-300:1000", 2, seed=4),
    )
    assert (
        a.lengths == b.lengths and a.lengths != parse_workload("uniform:30-300:1000", 2, 5).lengths
    )
    assert all(sum(r) == 1000 and all(1 <= n <= 300 for n in r) for r in a.lengths)
    d = parse_workload("decode:64:128", 2)
    assert d.decode and d.context == 128 and d.lengths == [[1] * 64] * 2


def test_a_sequence_longer_than_the_model_serves_is_refused_naming_the_limit():
    assert parse_workload("decode:4:100", 1).longest == 102  # context, new token, sampled one
    assert parse_workload("single-long:50", 2).longest == 51
    cfg = ModelConfig.from_hf("configs/qwen3-moe-tiny.json")
    positions = cfg.max_position_embeddings
    assert cfg.max_len() == cfg.max_len(positions + 1) == positions  # capped by the positions
    assert cfg.max_len(100) == 100
    check_fits("w", positions, cfg)
    with pytest.raises(ConfigError, match=f"w: a sequence of {positions + 1} tokens exceeds"):
        check_fits("w", positions + 1, cfg)
    with pytest.raises(ConfigError, match="context of 100 tokens \\(--max-model-len=100\\)"):
        check_fits("w", 101, cfg, max_model_len=100)


def test_file_workloads(tmp_path):
    flat = tmp_path / "flat.json"
    flat.write_text("[500, 100, 300, 300]")
    assert parse_workload(f"file:{flat}", 2).lengths == [[500], [100, 300, 300]]
    per_rank = tmp_path / "ranks.json"
    per_rank.write_text("[[5, 6], [7]]")
    assert parse_workload(f"file:{per_rank}", 2).lengths == [[5, 6], [7]]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("uniform:5-2", "A=5 is larger than B=2"),
        ("file:/no/such.json", "no file at"),
        ("uniform:x-9", "A='x' is not an integer"),
        ("decode:0", "BS=0 must be >= 1"),
        ("zipf:3", "unknown workload 'zipf:3'"),
    ],
)
def test_bad_workloads(spec, match):
    with pytest.raises(WorkloadError, match=match):
        parse_workload(spec, 2)


def test_bad_file_contents(tmp_path):
    path = tmp_path / "w.json"
    for text, match in (
        ('{"a": 1}', "must hold a non-empty JSON list"),
        ("[1, -3]", "positive"),
        ("[[1], [2], [3]]", "3 per-rank lists for 2 ranks"),
        ("[100]", "1 lengths cannot be dealt to 2 ranks"),
        ("[1,", "not valid JSON"),
        ("[[100, 200], 300, 5]", "positive integer"),  # a list among lengths: no TypeError
        ('[100, "a", 3]', "positive integer"),
    ):
        path.write_text(text)
        with pytest.raises(WorkloadError, match=match):
            parse_workload(f"file:{path}", 2)


def test_bench_end_to_end(tmp_path, capsys):
    out = {k: tmp_path / f"bench.{k}" for k in ("json", "trace", "png")}
    code = main(
        [
            "bench",
            "--hf-config",
            "configs/qwen3-moe-tiny.json",
            "--ep",
            "2",
            "--workload",
            "uniform:20-120:200",
            "--repeat",
            "2",
            "--modes",
            "none,tbo,tbo+two-chunk",
            "--json",
            str(out["json"]),
            "--trace",
            str(out["trace"]),
            "--plot",
            str(out["png"]),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "tbo+two-chunk" in printed and "speed-up" in printed
    report = json.loads(out["json"].read_text())
    assert set(report["modes"]) == {"none", "tbo", "tbo+two-chunk"}
    for mode in report["modes"].values():
        assert len(mode["times_s"]) == 2 and mode["median_s"] > 0 and mode["tokens_per_s"] > 0
        assert 0 <= mode["comm_hidden"] <= 1  # read off the mode's own timeline
    assert "hidden" in printed
    assert report["tokens_per_forward"] == 400 and report["t_comm_s"] > 0
    trace = json.loads(out["trace"].read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"tbo / rank 0", "tbo / rank 1", "compute mb0", "compute mb1", "communication"} <= names
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert any(e["name"].startswith("dispatch") for e in spans)
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_bad_modes(capsys):
    assert main(["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--modes", "tbo"]) == 2
    assert "must include none" in capsys.readouterr().err
    assert (
        main(["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--modes", "none,tbo9x"]) == 2
    )
    assert "tbo[N][+two-chunk|+time-split]" in capsys.readouterr().err
    tiny = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--workload", "nope"]
    assert main([*tiny, "--modes", "none,dbo"]) == 2  # asked for: refused on one process
    assert "--modes dbo: --enable-dbo needs more than one rank" in capsys.readouterr().err
    assert main(tiny) == 2  # the default list: dbo left out, named, and on to the workload
    err = capsys.readouterr().err
    assert "bench: dbo left out: --enable-dbo needs more than one rank" in err
    assert "unknown workload 'nope'" in err


def test_mode_names():
    from moe_overlap.core.errors import ConfigError
    from moe_overlap.core.mode_labels import mode_config

    assert mode_config("tbo").tbo_token_distribution_threshold == 0.0
    two_chunk = mode_config("tbo+two-chunk")
    assert (two_chunk.tbo_token_distribution_threshold, two_chunk.tbo_split_policy) == (
        0.48,
        "tokens",
    )
    four = mode_config("tbo4+time-split")
    assert (four.num_micro_batches, four.tbo_split_policy) == (4, "time")
    assert mode_config("dbo").mode == "dbo"
    for bad in ("tbo1", "tbo+fast", "xbo"):
        with pytest.raises(ConfigError, match="mode"):
            mode_config(bad)


def test_bench_under_tensor_parallelism_splits_its_communication(tmp_path, capsys):
    out = tmp_path / "tp.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--tp", "2", "--ep", "2"]
    argv += ["--workload", "single-long:64", "--repeat", "1", "--modes", "none,dbo"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "tp2 ep2" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert (report["tp"], report["ep"]) == (2, 2)
    # the attention all-reduces (T_tp) are measured apart from the all-to-all (T_comm)
    assert report["t_comm_s"] > 0 and report["t_tp_comm_s"] > 0
    assert report["limit_s"] >= report["t_tp_comm_s"]


def test_bench_trace_names_the_attention_tp_collectives_as_communication(tmp_path):
    """Under --tp the trace's ``tp comm`` track (the blocking attention all-reduces, T_tp) was
    labelled "compute tp comm", so a reader of the trace counted communication as compute."""
    out = tmp_path / "tp.trace.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--tp", "2", "--ep", "2"]
    argv += ["--workload", "single-long:32", "--repeat", "1", "--modes", "none"]
    assert main([*argv, "--trace", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    tp = {
        threads[e["pid"], e["tid"]]
        for e in events
        if e["ph"] == "X" and e["name"].startswith("attn_tp")
    }
    assert tp == {"attention-TP collectives (blocking)"}
    assert not any(name.startswith("compute") and "comm" in name for name in threads.values())


def test_plot_paths_are_checked_before_the_run_and_written_where_named(tmp_path, capsys):
    """A --plot suffix matplotlib cannot write (``t.txt``) failed only after the whole run, and
    a path without one was written as ``PATH.png`` while the command printed ``PATH``."""
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--workload", "nope"]
    with pytest.raises(SystemExit):  # refused as parsed: before the workload's error
        main([*argv, "--plot", str(tmp_path / "t.txt")])
    err = capsys.readouterr().err
    assert "--plot" in err and "'.txt'" in err and ".png" in err and "unknown workload" not in err
    plan = ["plan", "--hf-config", "configs/qwen3-moe-tiny.json", "--cluster", "1x8-h100"]
    with pytest.raises(SystemExit):
        main([*plan, "--ep", "2", "--plot", str(tmp_path / "p.txt")])
    assert "'.txt'" in capsys.readouterr().err
    bare, svg = tmp_path / "timeline", tmp_path / "timeline.svg"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--workload", "single-long:16"]
    for path in (bare, svg):
        assert main([*argv, "--modes", "none", "--repeat", "1", "--plot", str(path)]) == 0
        assert f"timeline: {path}" in " ".join(capsys.readouterr().out.split())
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in svg.read_bytes()[:400]
    assert not (tmp_path / "timeline.png").exists()


def test_bench_takes_the_references_backend_under_attention_tp(capsys):
    """--moe-a2a-backend deepep_low_latency at tp2 ep2: 64 tokens fit a capacity of 32, as
    each attention-TP rank sends its half, and the table's title names the dispatch."""
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--tp", "2", "--ep", "2"]
    argv += ["--moe-a2a-backend", "deepep_low_latency", "--num-max-dispatch-tokens-per-rank"]
    argv += ["32", "--workload", "single-long:64", "--repeat", "1", "--modes", "none,tbo"]
    assert main(argv) == 0
    assert "--a2a-mode low_latency" in " ".join(capsys.readouterr().out.split())


def test_bench_says_which_pipeline_micro_batch_fell_back(tmp_path):
    """Under --pp each pipeline micro-batch decides for itself: one decoding sequence leaves
    one of them idle and the other unsplittable, and the note names each."""
    out = tmp_path / "pp.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--tp", "2", "--pp", "2"]
    argv += ["--workload", "decode:1", "--repeat", "1", "--modes", "none,tbo"]
    assert main([*argv, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["modes"]["tbo"]["notes"] == [
        "ran without overlap (pp mb0: every rank is idle; pp mb1: a rank cannot split its batch)"
    ]


def test_bench_marks_modes_that_ran_an_empty_micro_batch_or_no_overlap(tmp_path, capsys):
    """Plain tbo on one sequence per rank leaves micro-batch 0 with no rows, and dbo below its
    token threshold runs without overlap: the table footnotes both, the JSON names both."""
    out = tmp_path / "bench.json"
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--ep", "2"]
    argv += [
        "--workload",
        "single-long:64",
        "--repeat",
        "1",
        "--modes",
        "none,tbo,tbo+two-chunk,dbo",
    ]
    assert main([*argv, "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # the caption wraps anywhere
    report = json.loads(out.read_text())
    notes = {mode: m["notes"] for mode, m in report["modes"].items()}
    assert notes["none"] == notes["tbo+two-chunk"] == []  # two-chunk cuts the sequence
    assert notes["tbo"] == [
        "micro-batch 0 empty on ranks 0, 1 (one sequence cannot be split by sequence; use "
        "tbo+two-chunk)"
    ]
    assert notes["dbo"] == ["ran without overlap (ranks [0, 1] voted no)"]
    assert "│ tbo [1] " in printed and "│ dbo [2] " in printed
    assert f"[1] tbo: {notes['tbo'][0]}" in printed and f"[2] dbo: {notes['dbo'][0]}" in printed
    # the planner's zero-host-cost bound from the measured T_comp and T_comm, per mode
    total = report["t_comp_s"] + report["t_comm_s"]
    for m in report["modes"].values():
        assert report["limit_s"] * (1 - 1e-9) <= m["zero_host_bound_s"] <= total * (1 + 1e-9)
        assert m["zero_host_bound_share"] == pytest.approx(m["zero_host_bound_s"] / m["median_s"])
    assert report["modes"]["none"]["zero_host_bound_s"] == pytest.approx(total)
    assert report["modes"]["tbo"]["zero_host_bound_s"] == pytest.approx(total)  # nothing split
    assert report["modes"]["tbo+two-chunk"]["zero_host_bound_s"] < total


def test_bench_takes_the_kv_pools_flags_and_hands_them_to_its_engine():
    """The pool's page size and budget (what --compare-dispatch-dtype's help asks a GPU user to
    halve) reach the bench's engine; the sequences and their length stay sized by the workload."""
    argv = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--workload", "decode:8:32"]
    argv += ["--page-size", "4", "--mem-fraction-static", "0.4", "--max-total-tokens", "512"]
    args = build_parser().parse_args(argv)
    workload = parse_workload(args.workload, 1, seed=0)
    engine = bench_engine_kwargs(args, workload)
    assert (engine["page_size"], engine["mem_fraction_static"]) == (4, 0.4)
    assert engine["max_total_tokens"] == 512 and engine["max_num_seqs"] == 8
