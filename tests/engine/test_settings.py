"""One source of truth for settings: the flags are generated from the dataclasses, every
subcommand shows one default per flag, SGLang's and vLLM's spellings parse to the same
settings, and a YAML --config file of flags works as theirs do."""

from __future__ import annotations

import argparse
import dataclasses
import shutil

import pytest

from moe_overlap import LLM, SamplingParams
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.engine.args import BenchArgs
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.engine.tokenizer import write_tokenizer
from moe_overlap.server.settings import ServerSettings
from moe_overlap.tools import command_flags
from moe_overlap.tools.cli import main
from moe_overlap.tools.cli_args import engine_args, mode_configs
from moe_overlap.tools.commands import build_parser
from moe_overlap.tools.flags import expand_config, field_help, flag_name
from tests.helpers import TINY

CONFIG = "configs/qwen3-moe-tiny.json"
SETTINGS = {
    f.name: f for cls in (EngineArgs, ServerSettings) for f in dataclasses.fields(cls) if f.metadata
}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(expand_config(argv))


def test_every_setting_is_a_flag_of_serve_with_the_fields_default_choices_and_aliases():
    actions: dict[str, argparse.Action] = {}
    for a in subcommands()["serve"]._actions:
        actions.setdefault(a.dest, a)  # a switch's first flag: --name, --no-name
    negations = {o for a in subcommands()["serve"]._actions for o in a.option_strings}
    for name, f in SETTINGS.items():
        assert set(f.metadata.get("negations", ())) <= negations, name
        action = actions[name]  # every engine and server setting is a serve flag
        assert action.default == f.default, name
        assert flag_name(name) in action.option_strings
        assert set(f.metadata.get("aliases", ())) <= set(action.option_strings), name
        assert tuple(action.choices or ()) == tuple(f.metadata.get("choices", ())), name


def test_each_flag_has_one_default_across_subcommands():
    seen = 0
    for command, parser in subcommands().items():
        for action in parser._actions:
            if action.dest in SETTINGS and action.dest not in ("hf_config",):
                assert action.default == SETTINGS[action.dest].default, (command, action.dest)
                seen += 1
    assert seen > 100  # generate, serve, bench-serve, bench, plan, probe-link, ... all checked


def test_the_bench_and_plan_commands_write_no_flag_by_hand():
    """Every flag of these commands is generated from a settings field or from a field of the
    command's own dataclass (``tools/command_flags.py``): its help is that field's."""
    classes = (EngineArgs, ServerSettings, BenchArgs)
    classes += tuple(c for c in vars(command_flags).values() if dataclasses.is_dataclass(c))
    helps: dict[str, set[str]] = {}
    negations = {o for f in SETTINGS.values() for o in f.metadata.get("negations", ())}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if "help" in f.metadata:
                helps.setdefault(f.name, set()).add(field_help(f))
    commands = ("bench", "bench-serve", "bench-engine", "plan", "probe-link", "serve")
    for command in commands:
        for action in subcommands()[command]._actions:
            if action.dest != "help" and action.option_strings:  # positionals are not flags
                if action.help == argparse.SUPPRESS:  # a negation, named in its switch's help
                    assert action.option_strings[0] in negations, (command, action.dest)
                    continue
                assert action.help in helps.get(action.dest, ()), (command, action.dest)


def test_the_ep_default_is_the_same_in_every_command():
    defaults = {
        command: next(a.default for a in parser._actions if a.dest == "ep")
        for command, parser in subcommands().items()
        if any(a.dest == "ep" for a in parser._actions)
    }
    assert set(defaults) >= {"generate", "serve", "bench", "plan", "probe-link", "bench-serve"}
    assert set(defaults.values()) == {1}


SPELLINGS = [  # (theirs, ours)
    (["--tp-size", "2"], ["--tp", "2"]),
    (["--tensor-parallel-size", "2"], ["--tp", "2"]),
    (["-tp", "2"], ["--tp", "2"]),
    (["--dp-size", "2"], ["--dp", "2"]),
    (["--data-parallel-size", "2"], ["--dp", "2"]),
    (["-dp", "2"], ["--dp", "2"]),
    (["--ep-size", "2"], ["--ep", "2"]),
    (["--expert-parallel-size", "2"], ["--ep", "2"]),
    (["--pp-size", "2"], ["--pp", "2"]),
    (["--pipeline-parallel-size", "2"], ["--pp", "2"]),
    (["-pp", "2"], ["--pp", "2"]),
    (["--context-length", "100"], ["--max-model-len", "100"]),
    (["--max-running-requests", "8"], ["--max-num-seqs", "8"]),
    (["--chunked-prefill-size", "64"], ["--max-num-batched-tokens", "64"]),
    (["--random-seed", "7"], ["--seed", "7"]),
    (["--gpu-memory-utilization", "0.8"], ["--mem-fraction-static", "0.8"]),
    (["--kv-cache-memory-bytes", "1048576"], ["--kv-cache-memory", "1048576"]),
    (["--block-size", "32"], ["--page-size", "32"]),
]


def test_memory_budget_flags_parse_to_their_fields():
    args = engine_args(
        parse(
            "serve",
            *("--hf-config", CONFIG, "--kv-cache-memory", "4096", "--page-size", "8"),
            *("--mem-fraction-static", "0.85", "--max-total-tokens", "1024"),
        )
    )
    assert (args.kv_cache_memory, args.page_size) == (4096, 8)
    assert (args.mem_fraction_static, args.max_total_tokens) == (0.85, 1024)
    defaults = engine_args(parse("serve", "--hf-config", CONFIG))
    assert defaults.kv_cache_memory is None and defaults.max_total_tokens is None
    assert (defaults.page_size, defaults.mem_fraction_static) == (16, 0.9)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize(("theirs", "ours"), SPELLINGS)
def test_sglang_and_vllm_spellings_parse_to_our_settings(command, theirs, ours):
    tail = ["--prompt-ids", "1"] if command == "generate" else []
    mine = engine_args(parse(command, "--hf-config", CONFIG, *ours, *tail))
    assert engine_args(parse(command, "--hf-config", CONFIG, *theirs, *tail)) == mine
    assert mine != engine_args(parse(command, "--hf-config", CONFIG, *tail))


def test_model_path_with_load_format_dummy_means_random_weights_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    args = engine_args(
        parse(
            "generate", "--model-path", str(tmp_path), "--load-format", "dummy", "--prompt-ids", "1"
        )
    )
    assert args.model_source() == (None, f"{tmp_path}/config.json")
    args = engine_args(
        parse("generate", "--model-path", CONFIG, "--load-format", "dummy", "--prompt-ids", "1")
    )
    assert args.model_source() == (None, CONFIG)
    loaded = engine_args(parse("generate", "--model-path", str(tmp_path), "--prompt-ids", "1"))
    assert loaded.model_source() == (str(tmp_path), None)


def test_llm_keyword_names_and_their_aliases_are_the_flags_names():
    assert EngineArgs.from_kwargs(tensor_parallel_size=2, context_length=64) == EngineArgs(
        tp=2, max_model_len=64
    )
    with pytest.raises(ConfigError, match="unknown engine setting 'tensor_parallel'"):
        EngineArgs.from_kwargs(tensor_parallel=2)
    with pytest.raises(ConfigError, match="'tp_size' and 'tp' name the same setting"):
        EngineArgs.from_kwargs(tp=2, tp_size=2)
    with pytest.raises(ConfigError, match="--load-format='safetensor' must be one of auto, dummy"):
        EngineArgs.from_kwargs(load_format="safetensor")


def test_an_overlap_setting_beside_a_whole_overlap_config_is_refused_not_ignored():
    """``LLM(overlap=OverlapConfig(...))`` holds every overlap setting: one given beside it
    (by its name, an alias or a scheme's switch) would be silently dropped, so it is refused
    before any rank starts."""
    whole = OverlapConfig("tbo")
    for kwargs, named in [
        (dict(moe_dispatch_dtype="fp8"), "moe_dispatch_dtype"),
        (dict(deepep_mode="low_latency"), "a2a_mode"),  # SGLang's alias
        (dict(enable_two_batch_overlap=True), "enable_two_batch_overlap"),
    ]:
        with pytest.raises(ConfigError, match=f"so {named} beside it would be ignored"):
            LLM(config=ModelConfig(**TINY["qwen3_moe"]), overlap=whole, **kwargs)


def test_a_yaml_config_of_flags_and_the_command_line_overriding_it(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "flags.yaml"
    path.write_text("tp-size: 2\nep: 2\nenable_dbo: true\nauto-modes: [none, sbo]\nseed: 3\n")
    args = engine_args(parse("serve", "--config", str(path), "--hf-config", CONFIG, "--seed", "5"))
    assert (args.tp, args.ep, args.enable_dbo, args.seed) == (2, 2, True, 5)
    assert args.auto_modes == ("none", "sbo")
    assert args.overlap_config().mode == "dbo"
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert all("--config FILE" in p.format_help() for p in sub.choices.values())  # in --help


def test_a_hugging_face_config_given_to_config_names_the_new_flag(capsys):
    assert main(["generate", "--config", CONFIG, "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--hf-config {CONFIG}" in err and "YAML file of flags" in err


def test_a_config_path_given_to_the_llm_names_the_keyword_that_takes_one():
    with pytest.raises(
        ConfigError, match="must be a ModelConfig; for a config.json give hf_config"
    ):
        LLM(config=CONFIG)


@pytest.mark.parametrize(
    ("text", "words"),
    [("- a\n- b\n", "must be a YAML mapping"), ("a: [\n", "is not valid YAML")],
)
def test_a_bad_config_file_fails_with_one_line(tmp_path, capsys, text, words):
    pytest.importorskip("yaml")
    path = tmp_path / "flags.yaml"
    path.write_text(text)
    assert main(["generate", "--config", str(path), "--prompt-ids", "1"]) == 2
    assert words in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("moe-overlap ")


def test_load_format_dummy_builds_the_same_random_weights_as_hf_config():
    prompts, params = (
        [[1, 2, 3], [4, 5]],
        SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True),
    )
    with LLM(CONFIG, load_format="dummy", random_seed=3) as llm:
        dummy = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(hf_config=CONFIG, seed=3) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == dummy
    with LLM(config=ModelConfig.from_hf(CONFIG), seed=3) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == dummy


def test_load_format_dummy_keeps_the_model_directorys_tokenizer(tmp_path):
    """As in SGLang and vLLM, dummy replaces the weights only: text prompts still work."""
    shutil.copy(CONFIG, tmp_path / "config.json")
    write_tokenizer(tmp_path, ModelConfig.from_hf(CONFIG).vocab_size)
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    with LLM(str(tmp_path), load_format="dummy", random_seed=3) as llm:
        assert llm.tokenizer is not None
        dummy = llm.generate(["Hello"], params)[0]
    assert len(dummy.token_ids) == 2 and isinstance(dummy.text, str)
    with LLM(hf_config=CONFIG, seed=3) as llm:
        assert llm.tokenizer is None


def test_prefix_caching_is_on_by_default_and_each_engines_spelling_turns_it_off():
    assert parse("serve", "--model", CONFIG).enable_prefix_caching is True
    for off in ("--no-enable-prefix-caching", "--disable-radix-cache"):
        assert parse("serve", "--model", CONFIG, off).enable_prefix_caching is False, off
    assert EngineArgs.from_kwargs(disable_radix_cache=True).enable_prefix_caching is False
    assert EngineArgs.from_kwargs(enable_prefix_caching=False).enable_prefix_caching is False


def test_the_benches_modes_carry_the_overlap_flags_given():
    """``bench`` and ``bench-serve`` start each mode from its label; every other overlap flag
    given is that mode's too."""
    flags = ["--moe-dispatch-dtype", "fp8", "--a2a-mode", "low_latency"]
    flags += ["--num-max-dispatch-tokens-per-rank", "64", "--tbo-min-tokens", "3"]
    flags += ["--sbo-combine-blocks", "2", "--dbo-decode-token-threshold", "5"]
    serve_only = ["--moe-a2a-backend", "torch"]  # bench's ranks build the default backend
    for command, extra in (("bench", []), ("bench-serve", serve_only)):
        args = parse(command, "--hf-config", CONFIG, *flags, *extra)
        configs = mode_configs(args, ["none", "tbo3+time-split", "auto"])
        assert [c.mode for c in configs.values()] == ["none", "tbo", "auto"]
        assert configs["tbo3+time-split"].num_micro_batches == 3
        assert configs["tbo3+time-split"].tbo_split_policy == "time"
        for config in configs.values():
            assert config.moe_dispatch_dtype == "fp8" and config.a2a_mode == "low_latency"
            assert config.num_max_dispatch_tokens_per_rank == 64
            assert (config.tbo_min_tokens, config.sbo_combine_blocks) == (3, 2)
            assert config.dbo_decode_token_threshold == 5
            if extra:
                assert config.moe_a2a_backend == "torch"
    for given in (["--overlap", "dbo"], ["--enable-two-batch-overlap"]):
        args = parse("bench-serve", "--hf-config", CONFIG, *given)
        with pytest.raises(
            ConfigError, match="would be ignored: a bench runs each mode of --modes"
        ):
            mode_configs(args, ["none", "tbo"])
