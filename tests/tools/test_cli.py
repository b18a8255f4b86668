"""The moe-overlap command line: generate, make-model, and error exits."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.errors import ConfigError
from moe_overlap.distributed import netns
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.tools.bench_serve import free_port
from moe_overlap.tools.bench_serve_cli import _rates
from moe_overlap.tools.cli import forks_ranks, main
from moe_overlap.tools.commands import build_parser, parse_ids

CONFIG = "configs/qwen3-moe-tiny.json"


def test_make_model_then_generate_prints_the_same_tokens_as_the_api(tmp_path, capsys):
    assert main(["make-model", "--hf-config", CONFIG, "--out", str(tmp_path), "--seed", "1"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path),
                "--prompt-ids",
                "1,2,3",
                "--prompt-ids",
                "7,8",
                "--max-new-tokens",
                "4",
                "--ignore-eos",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.split()
    with LLM(config=ModelConfig.from_hf(CONFIG), seed=1) as llm:
        outs = llm.generate(
            [[1, 2, 3], [7, 8]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        )
    assert lines == [",".join(map(str, o.token_ids)) for o in outs]


def test_make_model_writes_a_tokenizer_and_generate_takes_text(tmp_path, capsys):
    assert main(["make-model", "--hf-config", CONFIG, "--out", str(tmp_path)]) == 0
    assert (tmp_path / "tokenizer.json").is_file()
    args = ["generate", "--model", str(tmp_path), "--max-new-tokens", "4", "--ignore-eos"]
    capsys.readouterr()
    assert main([*args, "--prompt", "The cat sat"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    with LLM(tmp_path) as llm:  # both sample at the one default temperature, same seeds
        out = llm.generate(["The cat sat"], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert out.text is not None and printed == out.text


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["generate", "--hf-config", CONFIG, "--prompt-ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    out = str(tmp_path / "m")
    assert main(["make-model", "--hf-config", CONFIG, "--out", out, "--fp8-block", "32"]) == 2
    assert "--fp8-block 32,32 needs --quantize fp8" in capsys.readouterr().err
    assert main(["probe-link", "--ep", "2", "--mib", "1e9"]) == 2  # refused before any rank
    assert "lower --mib" in capsys.readouterr().err
    # a full-size config: refused before a byte is allocated (DeepSeek-V3: 2.5 TB in fp32)
    assert main(["make-model", "--hf-config", "configs/deepseek-v3.json", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "about 2499.8 GiB in float32" in err and "fewer num_hidden_layers" in err
    assert not (tmp_path / "m").exists()


def test_cleanup_says_which_namespaces_it_could_not_remove(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netns, "NETNS_DIR", str(tmp_path))
    monkeypatch.setattr(netns, "_run", lambda command, check=True: None)  # as without root
    (tmp_path / "moeo999999999-1-abc123-r0").touch()  # beyond any pid_max: its owner is gone
    (tmp_path / "other-namespace").touch()
    assert main(["cleanup"]) == 1
    captured = capsys.readouterr()
    assert "removed 0 network namespace(s)" in captured.out
    assert captured.err.splitlines() == [
        "moe-overlap: error: could not remove 1 network namespace(s) "
        "(moeo999999999-1-abc123-r0); deleting them needs root"
    ]


def test_serve_takes_the_model_as_vllm_does_and_errors_show_its_usage(capsys):
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "give the model once" in capsys.readouterr().err
    try:
        main(["serve", "--no-such-flag"])
    except SystemExit as exit_:
        assert exit_.code == 2
    err = capsys.readouterr().err
    assert "usage: moe-overlap serve" in err and "--no-such-flag" in err


def test_vllm_launch_flags(capsys):
    assert EngineArgs(tp=2, enable_expert_parallel=True).parallel_config().ep == 2
    with pytest.raises(ConfigError, match="--enable-expert-parallel sets --ep"):
        EngineArgs(tp=2, ep=4, enable_expert_parallel=True).parallel_config()
    args = ["generate", "--hf-config", CONFIG, "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main([*args, "--trust-remote-code"]) == 0
    assert "no code from a checkpoint runs here" in capsys.readouterr().err


def test_every_commands_help_renders(capsys):
    """argparse formats each flag's help with %: one stray % in a field's help broke a
    command's --help (generate's, over --kv-cache-memory's "40% of")."""
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in commands:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0, name
        assert f"usage: moe-overlap {name}" in capsys.readouterr().out


def test_a_command_that_forks_ranks_starts_the_fork_server_before_importing_torch():
    """The entry guesses from the raw arguments whether ranks will be forked, and loads no
    torch before it has started the fork server (whose own import then runs beside ours)."""
    assert forks_ranks(["serve", "--model", "m", "--ep", "2"])
    assert forks_ranks(["generate", "--tp=4", "--prompt", "x"])
    assert forks_ranks(["bench", "--emulate-peers", "8", "--ep", "1"])
    assert not forks_ranks(["serve", "--model", "m"])  # one process
    assert not forks_ranks(["serve", "--ep", "2", "--help"])
    assert not forks_ranks(["make-model", "--ep", "2"])
    assert not forks_ranks(["bench", "--ep"])  # a value missing: argparse will say so
    assert not forks_ranks([])
    code = "import sys, moe_overlap.tools.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_an_output_path_that_cannot_be_a_file_is_refused_before_the_run(tmp_path, capsys):
    """``--json``/``--trace``/``--plot`` naming a directory, or a path under a file, fail as
    the flags are parsed (exit 2, the path named), not with a traceback after the run."""
    (tmp_path / "file").write_text("")
    bench = ["bench", "--hf-config", "configs/qwen3-moe-tiny.json", "--modes", "none"]
    cases = {
        ("--json", str(tmp_path)): "is a directory",
        ("--trace", str(tmp_path / "file" / "t.json")): "cannot be written",
    }
    for (flag, path), error in cases.items():
        for argv in ([*bench, flag, path], ["plan", "--reproduce", flag, path]):
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            assert exit_.value.code == 2
            assert f"argument {flag}: {path!r} {error}" in capsys.readouterr().err


def test_a_checkpoint_a_rank_refuses_is_one_error_line_at_every_ep(tmp_path, capsys):
    """A bad checkpoint is refused with exit 2 and the loader's message alone at --ep 2 too,
    where a rank finds it: not exit 1 with the rank's traceback appended."""
    assert main(["make-model", "--hf-config", CONFIG, "--out", str(tmp_path)]) == 0
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, str(weights))
    capsys.readouterr()
    for ep in ("1", "2"):
        assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1", "--ep", ep]) == 2
        err = capsys.readouterr().err
        assert "'model.layers.1.self_attn.q_proj.weight' is missing from the checkpoint" in err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_bench_serve_base_url_is_checked_and_an_unreachable_server_named(capsys):
    """A --base-url that is no http(s) URL is refused as it is parsed (it connected to
    127.0.0.1:80 before); a server that cannot be reached is one error line naming it, not a
    ConnectionRefusedError traceback."""
    load = ["bench-serve", "--num-requests", "1", "--output-len", "1", "--vocab-size", "100"]
    for bad in ("notaurl", "ftp://host", "http://127.0.0.1:99999"):
        with pytest.raises(SystemExit) as exit_:
            main([*load, "--base-url", bad])
        assert exit_.value.code == 2
        assert (
            f"argument --base-url: {bad!r}: want http(s)://HOST[:PORT]" in capsys.readouterr().err
        )
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main([*load, "--base-url", url]) == 1
    err = capsys.readouterr().err
    assert f"moe-overlap: error: cannot reach the server at {url}: " in err
    assert "Traceback" not in err


def test_an_empty_item_in_a_comma_list_is_refused_not_dropped():
    assert parse_ids("1, 2,3") == [1, 2, 3]
    with pytest.raises(argparse.ArgumentTypeError, match="'1,2,,3'"):
        parse_ids("1,2,,3")
    assert _rates("1, 4,inf") == [1.0, 4.0, float("inf")]
    with pytest.raises(ConfigError, match="'1,,2'"):
        _rates("1,,2")
