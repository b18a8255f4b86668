"""The moe-overlap command line: generate, make-model, and error exits."""

from __future__ import annotations

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.tools.cli import main

CONFIG = "configs/qwen3-moe-tiny.json"


def test_make_model_then_generate_prints_the_same_tokens_as_the_api(tmp_path, capsys):
    assert main(["make-model", "--config", CONFIG, "--out", str(tmp_path), "--seed", "1"]) == 0
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
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.split()
    with LLM(config=ModelConfig.from_hf(CONFIG), seed=1) as llm:
        outs = llm.generate([[1, 2, 3], [7, 8]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert lines == [",".join(map(str, o.token_ids)) for o in outs]


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["generate", "--config", CONFIG, "--prompt-ids", "1,99999"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
