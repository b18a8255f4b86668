"""Bad values and flag files on the command line: one error line naming the flag, or the
value taken as written; each found by trying the commands as a user would."""

from __future__ import annotations

import json
import time

import pytest

from moe_overlap.core.workloads import parse_workload
from moe_overlap.tools.cli import main
from moe_overlap.tools.commands import build_parser
from moe_overlap.tools.flags import expand_config, switches

CONFIG = "configs/qwen3-moe-tiny.json"


def test_plan_cluster_this_refuses_repeat_0_naming_it_before_measuring(capsys):
    """``--repeat 0`` measured the machine, then failed with statistics' 'no median for
    empty data', naming no flag."""
    argv = ["plan", "--hf-config", CONFIG, "--cluster", "this", "--repeat", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--repeat=0 must be >= 1" in err and "median" not in err


def test_a_false_in_a_config_file_turns_an_on_by_default_switch_off(tmp_path):
    """``enable-prefix-caching: false`` was dropped as if absent, leaving the cache on."""
    pytest.importorskip("yaml")
    path = tmp_path / "flags.yaml"
    path.write_text("enable-prefix-caching: false\nenable-dbo: false\nep: 2\n")
    argv = ["serve", "--config", str(path), "--hf-config", CONFIG]
    parser = build_parser()  # main's parse: the file read with the parser's switches
    args = parser.parse_args(expand_config(argv, switches(parser)))
    assert (args.enable_prefix_caching, args.enable_dbo, args.ep) == (False, False, 2)
    on = ["serve", "--config", str(path), "--hf-config", CONFIG, "--enable-prefix-caching"]
    assert parser.parse_args(expand_config(on, switches(parser))).enable_prefix_caching


def test_a_chat_template_path_that_does_not_exist_is_refused_not_used_as_the_template(
    tmp_path, capsys
):
    """A mistyped ``--chat-template`` file was taken as the template's own text, so every chat
    rendered as the path; like vLLM, text with no Jinja in it that names no file is refused."""
    model = tmp_path / "model"
    assert main(["make-model", "--hf-config", CONFIG, "--out", str(model)]) == 0
    missing = str(tmp_path / "tempalte.jinja")
    gen = ["generate", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1"]
    capsys.readouterr()
    assert main([*gen, "--chat-template", missing]) == 2
    err = capsys.readouterr().err
    assert f"--chat-template {missing!r}: no such file" in err and "Traceback" not in err
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert main([*gen, "--chat-template", template]) == 0  # a template given inline still is


def test_make_model_out_that_is_a_file_is_refused_naming_the_flag(tmp_path, capsys):
    """``--out`` naming a file (or a path under one) failed after building the weights with
    '[Errno 17] File exists' and exit 1, naming no flag."""
    (tmp_path / "f").write_text("keep")
    for out in (tmp_path / "f", tmp_path / "f" / "model"):
        assert main(["make-model", "--hf-config", CONFIG, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: " in err and "is a file" in err and "Errno" not in err
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--max-new-tokens", "0", "--max-new-tokens=0 must be >= 1"),
        ("--temperature", "-1", "--temperature=-1.0 must be >= 0"),
        ("--top-p", "2", "--top-p=2.0 must be in (0, 1]"),
        ("--top-k", "-5", "--top-k=-5 must be an integer >= -1"),
        ("--min-p", "2", "--min-p=2.0 must be in [0, 1]"),
    ],
)
def test_generate_names_a_bad_sampling_flag_as_a_flag(capsys, flag, value, words):
    """The refusals named the Python field (max_new_tokens=0 ... '0 needs prompt_logprobs', a
    keyword generate has no flag for), not the flag the user typed."""
    argv = ["generate", "--hf-config", CONFIG, "--prompt-ids", "1", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "prompt_logprobs" not in err


def test_a_large_workload_is_drawn_and_dealt_in_linear_time(tmp_path):
    """uniform:A-B:T summed the lengths drawn so far at every draw (quadratic: uniform:1-2:200000
    spent over a minute before any forward ran), and file: dealt each length to the rank with
    the fewest tokens by summing every rank's list again."""
    started = time.perf_counter()
    drawn = parse_workload("uniform:1-2:200000", ranks=2, seed=0)
    assert [sum(lengths) for lengths in drawn.lengths] == [200000, 200000]
    path = tmp_path / "w.json"
    path.write_text(json.dumps([1] * 200000))
    dealt = parse_workload(f"file:{path}", ranks=4, seed=0)
    assert [len(lengths) for lengths in dealt.lengths] == [50000] * 4
    assert time.perf_counter() - started < 3  # seconds; about 0.5 linear, minutes quadratic
