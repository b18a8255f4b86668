"""vLLM's --eplb-config JSON through the one settings home: its keys read onto our EPLB flags,
a flag of ours that disagrees refused naming both, unknown keys and values we cannot honour
refused by name; the EPLB count flags parse as integers."""

from __future__ import annotations

import json

import pytest

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.tools.cli import main
from moe_overlap.tools.cli_args import engine_args
from moe_overlap.tools.commands import build_parser

CONFIG = "configs/qwen3-moe-tiny.json"
VLLM = {"window_size": 500, "step_interval": 2000, "num_redundant_experts": 8}


def settings(*flags: str) -> EngineArgs:
    return engine_args(build_parser().parse_args(["serve", "--hf-config", CONFIG, *flags]))


def test_vllms_keys_set_our_flags():
    defaults = {"log_balancedness": False, "log_balancedness_interval": 10, "use_async": False}
    args = settings("--eplb-config", json.dumps(VLLM | defaults | {"policy": "default"}))
    assert (args.eplb_window_size, args.eplb_rebalance_num_iterations) == (500, 2000)
    assert args.ep_num_redundant_experts == 8
    mine = settings(
        *("--eplb-window-size", "500", "--eplb-step-interval", "2000"),
        *("--ep-num-redundant-experts", "8", "--eplb-rebalance-layers-per-chunk", "2"),
    )
    assert (mine.eplb_window_size, mine.eplb_rebalance_layers_per_chunk) == (500, 2)  # ints
    both = settings("--eplb-config", json.dumps(VLLM), "--eplb-step-interval", "2000")
    assert both.eplb_rebalance_num_iterations == 2000  # the same value twice agrees
    again = EngineArgs.from_kwargs(eplb_config=VLLM, eplb_rebalance_num_iterations=2000)
    assert again.ep_num_redundant_experts == 8  # LLM(eplb_config={...}) takes the dict


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--eplb-config", '{"step_interval": 2000}', "--eplb-step-interval", "50"],
            "step_interval=2000 and --eplb-rebalance-num-iterations=50 disagree",
        ),
        (
            ["--eplb-config", '{"num_redundant_experts": 4}', "--ep-num-redundant-experts", "2"],
            "num_redundant_experts=4 and --ep-num-redundant-experts=2 disagree",
        ),
        (["--eplb-config", '{"window": 10, "step": 2}'], "unknown key 'step', 'window'"),
        (["--eplb-config", '{"log_balancedness": true}'], "log_balancedness=True: the balance"),
        (["--eplb-config", '{"use_async": true}'], "use_async=True: experts move at a step"),
        (["--eplb-config", '{"policy": "flashlb"}'], "policy='flashlb': vLLM's default policy"),
        (["--eplb-config", '{"window_size": 0}'], "window_size=0: want an integer >= 1"),
        (["--eplb-config", '{"step_interval": "9"}'], "step_interval='9': want an integer"),
        (["--eplb-config", "window_size=9"], "is not JSON"),
        (["--eplb-config", "[1]"], "want a JSON object"),
    ],
)
def test_refused_with_the_key_and_the_fix(flags, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        settings(*flags)


def test_the_command_line_prints_the_refusal_in_one_line(capsys):
    argv = ["generate", "--hf-config", CONFIG, "--prompt-ids", "1", "--eplb-config", '{"x": 1}']
    assert main(argv) == 2
    assert "--eplb-config: unknown key 'x'" in capsys.readouterr().err
