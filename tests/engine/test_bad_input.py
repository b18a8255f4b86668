"""Bad input is refused at once, with one line that names the field, and nothing is started."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from moe_overlap import LLM, ConfigError, InvalidRequestError, ModelConfig, SamplingParams
from moe_overlap.tools.cli import main
from tests.helpers import TINY

CONFIG = "configs/qwen3-moe-tiny.json"


@pytest.fixture(scope="module")
def llm():
    with LLM(config=ModelConfig(**TINY["qwen3_moe"]), seed=0) as engine:
        yield engine


def run_cli(capsys, *args: str) -> tuple[int, list[str]]:
    """Exit code and stderr lines of ``moe-overlap ARGS`` run in this process."""
    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": "x"}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_fields_are_checked(kw, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}="):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([1.7, 2.2], r"prompt 1 holds 1\.7 \(float\)"),
        ("123", "prompt 1 must be a list of token ids, not str"),
        ([True, 2], r"prompt 1 holds True \(bool\)"),
        ([None], r"prompt 1 holds None \(NoneType\)"),
        ("hello", "prompt 1 must be a list of token ids, not str"),
        (torch.tensor([1.0, 2.0]), "prompt 1 must be a 1-D integer array, got 1-D torch.float32"),
        (torch.tensor([[1, 2]]), "prompt 1 must be a 1-D integer array, got 2-D torch.int64"),
        (np.array([1.5]), "prompt 1 must be a 1-D integer array, got 1-D float64"),
        ([1, torch.tensor(2.0)], r"prompt 1 holds tensor\(2\.\) \(Tensor\)"),
        ([1, np.float32(2)], r"prompt 1 holds .*2\.0.* \(float32\)"),
        (7, "prompt 1 must be a list of token ids, not int"),
        ({"prompt_token_ids": [1], "multi_modal_data": {}}, "of vLLM's prompt dicts"),
    ],
)
def test_non_integer_token_ids_are_refused_with_the_prompt_index(llm, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([[1, 2], prompt], SamplingParams(temperature=0, max_new_tokens=2))


def test_vllms_prompt_dicts_are_prompts(llm):
    """vLLM's TokensPrompt and TextPrompt dicts, in a list or alone, are their prompts."""
    greedy = SamplingParams(temperature=0, max_new_tokens=2)
    (plain,) = llm.generate([[1, 2]], greedy)
    dicts = llm.generate([{"prompt_token_ids": [1, 2]}], greedy)
    assert [o.token_ids for o in dicts] == [plain.token_ids]
    assert llm.generate({"prompt_token_ids": [1, 2]}, greedy)[0].token_ids == plain.token_ids


def test_integer_token_ids_of_any_integer_type_are_accepted(llm):
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], params)[0].token_ids
    for prompt in (
        [np.int64(5), np.int32(6), 7],
        [torch.tensor(5), torch.tensor(6, dtype=torch.int32), torch.tensor(7)],
        torch.tensor([5, 6, 7]),
        np.array([5, 6, 7], dtype=np.uint8),
        (5, 6, 7),
    ):
        assert llm.generate([prompt], params)[0].token_ids == want


@pytest.mark.parametrize("value", [0, -1])
def test_max_num_seqs_below_one_is_refused(value):
    with pytest.raises(ConfigError, match=f"--max-num-seqs={value} must be an integer >= 1"):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), max_num_seqs=value)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--timeout", "0", "--timeout=0.0 must be a positive number of seconds"),
        ("--timeout", "-5", "--timeout=-5.0 must be a positive number of seconds"),
        ("--timeout", "nan", "--timeout=nan must be a positive number of seconds"),
        ("--max-model-len", "0", "--max-model-len=0 must be an integer >= 1"),
        ("--max-model-len", "-5", "--max-model-len=-5 must be an integer >= 1"),
        ("--max-num-seqs", "-1", "--max-num-seqs=-1 must be an integer >= 1"),
        ("--max-num-seqs", "0", "--max-num-seqs=0 must be an integer >= 1"),
        ("--max-num-batched-tokens", "0", "--max-num-batched-tokens=0 must be an integer >= 1"),
        # a GPU's share, refused on CPU too rather than ignored there
        ("--mem-fraction-static", "1.5", "--mem-fraction-static=1.5 must be a share in (0, 1]"),
        ("--mem-fraction-static", "0", "--mem-fraction-static=0.0 must be a share in (0, 1]"),
        ("--max-total-tokens", "0", "--max-total-tokens=0 must be an integer >= 1"),
        ("--kv-cache-memory", "-5", "--kv-cache-memory=-5 must be an integer >= 1"),
    ],
)
def test_engine_flags_exit_2_with_one_line_before_any_rank_starts(capsys, flag, value, message):
    start = time.monotonic()
    code, err = run_cli(
        capsys, "generate", "--hf-config", CONFIG, "--ep", "2", flag, value, "--prompt-ids", "1,2"
    )
    assert (code, err) == (2, [f"moe-overlap: error: {message}"])
    assert time.monotonic() - start < 5, "ranks were started before the flag was checked"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"ep": "2"}, r"--ep='2' must be an integer"),
        ({"ep": 2.0}, r"--ep=2.0 must be an integer"),
        ({"ep": 3}, "--ep=3 must divide num_experts=4"),
        ({"link": None}, "bad --link None: give a string"),
        ({"ep": 2, "link": None}, "bad --link None: give a string"),
        ({"link": "netns:2gbit"}, r"--link netns:2gbit needs more than one rank \(--ep or --tp"),
        ({"timeout_s": "60"}, "--timeout='60' must be a number"),
        ({"seed": -1}, "--seed=-1 must be an integer >= 0"),
        # a named tokenizer that is not there is refused, not silently dropped (no text)
        ({"tokenizer": "/nonexistent"}, "tokenizer='/nonexistent' is no directory holding a"),
    ],
)
def test_llm_arguments_name_the_fault(kw, match):
    with pytest.raises(ConfigError, match=match):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), **kw)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "1"], "--ep=1: probing a link needs 2 or more ranks"),
        (["--ep", "2", "--mib", "-1"], "--mib=-1 must be positive"),
        (["--ep", "2", "--mib", "0"], "--mib=0 must be positive"),
        (["--ep", "2", "--repeat", "0"], "--repeat=0 must be >= 1"),
    ],
)
def test_probe_link_arguments_exit_2_with_one_line(capsys, args, message):
    assert run_cli(capsys, "probe-link", *args) == (2, [f"moe-overlap: error: {message}"])


def test_probe_link_runs_outside_the_repository(tmp_path, monkeypatch, capsys):
    """Its default model is the repository's config, found from any directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["probe-link", "--ep", "2", "--mib", "0.01", "--repeat", "1"]) == 0
    assert "all-to-all of 0.01 MiB per rank over 2 ranks" in capsys.readouterr().out


def test_bench_workload_longer_than_the_context_fails_at_once(capsys):
    start = time.monotonic()
    code, err = run_cli(
        capsys,
        "bench",
        "--hf-config",
        CONFIG,
        "--workload",
        "single-long:999999",
        "--modes",
        "none",
    )
    assert code == 2 and len(err) == 1
    assert "a sequence of 1000000 tokens exceeds" in err[0]
    assert "max_position_embeddings=" in err[0]
    assert time.monotonic() - start < 5, "ranks were started before the workload was checked"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ep", "1", "--modes", "none,dbo"],
            "--modes dbo: --enable-dbo needs more than one rank",
        ),
        (["--tp", "2", "--pp", "2", "--modes", "none,auto"], "--modes auto: --overlap auto with"),
        (["--ep", "2", "--modes", "tbo"], "--modes 'tbo' must include none, the baseline"),
    ],
)
def test_bench_modes_the_layout_cannot_run_exit_2(capsys, args, message):
    code, err = run_cli(capsys, "bench", "--hf-config", CONFIG, *args)
    assert code == 2 and len(err) == 1 and message in err[0], err
