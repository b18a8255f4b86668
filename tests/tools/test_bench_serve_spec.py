"""``bench-serve --compare-speculative``: each mode's server with speculative decoding and
without it, the acceptance length read from the server's /metrics, and the closing note."""

from __future__ import annotations

import argparse
import json

import pytest

from moe_overlap.core.errors import ConfigError
from moe_overlap.tools.bench_serve_cli import add_bench_serve_command

TINY = "configs/qwen3-moe-tiny.json"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_command(parser.add_subparsers())
    return parser.parse_args(["bench-serve", *argv])


def test_compare_speculative_reports_acceptance_and_both_throughputs(tmp_path, capsys):
    out = tmp_path / "load.json"
    args = _parse(
        "--hf-config", TINY, "--modes", "none", "--rates", "inf", "--num-requests", "3",
        "--workload", "uniform:8-16", "--output-len", "16", "--compare-speculative",
        "--json", str(out),
    )  # fmt: skip
    assert args.func(args) == 0
    on, off = json.loads(out.read_text())["results"]
    assert (on["mode"], off["mode"]) == ("none", "none no-spec")
    assert on["spec_acceptance_length"] >= 1 and off["spec_acceptance_length"] is None
    assert on["total_output_tokens"] == off["total_output_tokens"] == 3 * 16
    printed = capsys.readouterr().out
    assert "speculative decoding on against off" in printed and "acceptance length" in printed


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--base-url", "http://x:1", "--compare-speculative"], "drop one of them"),
        (["--compare-speculative", "--compare-prefix-caching"], "give one of them"),
    ],
)
def test_compare_speculative_refusals(extra, match):
    args = _parse("--hf-config", TINY, *extra)
    with pytest.raises(ConfigError, match=match):
        args.func(args)
