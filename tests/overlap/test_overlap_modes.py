"""The overlap-mode registry is the one home of a mode's facts: a mode added there reaches the
flags, the bench's grammar, the planner, auto and the layout refusals, and no other module
spells a mode's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.mode_labels import command_flags, mode_config
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, TBO, AutoChoice, OverlapMode, Refusal, Runs
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.overlap import predict
from moe_overlap.overlap.predict import Calibration, StepStats, choose
from moe_overlap.overlap.schemes import scheme_class
from moe_overlap.overlap.tbo import TwoBatchOverlap
from moe_overlap.planner.cluster import load_cluster
from moe_overlap.planner.inputs import load_model_spec, make_layout
from moe_overlap.planner.plan import Planner
from moe_overlap.tools.cli import main

SRC = Path(__file__).resolve().parents[2] / "src" / "moe_overlap"
REGISTRY = SRC / "core" / "overlap_modes.py"
# "none" and "auto" also name values of other settings; these modules own those
OTHER_ENUMS = {
    "core/a2a_mode.py": "--moe-a2a-backend none/auto, --a2a-mode auto",
    "core/device.py": "--device auto",
    "core/eplb_placement.py": "--eplb-algorithm auto",
    "distributed/link.py": "--link none",
    "engine/args.py": "--load-format auto, --link none",
    "server/unsupported.py": "OpenAI's function_call none/auto",
    "server/tools.py": "OpenAI's tool_choice none/auto",
}
SHARED_WORDS = {"none", "auto"}


def _literals(path: Path) -> list[tuple[int, str]]:
    """Every string constant of ``path`` but the docstrings, with its line."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_mode_names_are_string_literals_only_in_the_registry() -> None:
    names = set(MODES) | set(MODES.auto_choices())
    found = []
    for path in SRC.rglob("*.py"):
        if path == REGISTRY:
            continue
        rel = str(path.relative_to(SRC))
        allowed = SHARED_WORDS if rel in OTHER_ENUMS else set()
        found += [f"{rel}:{line} {v!r}" for line, v in _literals(path) if v in names - allowed]
    assert not found, f"mode names outside core/overlap_modes.py: {found}"


DUMMY = OverlapMode(
    "xbo",
    "a test's mode: TBO's scheme under another name",
    Runs.SPLIT,
    scheme=TBO.scheme,
    flag="--overlap xbo",
    micro_batches=2,
    knobs=TBO.knobs,
    refusals=(Refusal(lambda par: par.ep == 3, "xbo refuses --ep {par.ep}"),),
    with_pdmux=False,
    auto_choices=(AutoChoice("xbo4", (("num_micro_batches", 4),)),),
)


@pytest.fixture
def dummy():
    MODES.register(DUMMY)
    predict.shape.cache_clear()
    yield DUMMY
    MODES.unregister(DUMMY.name)
    predict.shape.cache_clear()


def test_a_mode_added_to_the_registry_reaches_every_reader(dummy, capsys) -> None:
    # the flags: --overlap takes it, and so does LLM(overlap=...)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "xbo" in capsys.readouterr().out
    assert EngineArgs(overlap="xbo").overlap_config().mode == "xbo"
    # bench --modes: the grammar of a split mode, and the flags it prints back
    cfg = mode_config("xbo3+time-split")
    assert (cfg.mode, cfg.num_micro_batches, cfg.tbo_split_policy) == ("xbo", 3, "time")
    assert command_flags(cfg) == "--overlap xbo --num-micro-batches 3 --tbo-split-policy time"
    assert scheme_class("xbo") is TwoBatchOverlap
    # the planner runs it as the split it is: two micro-batches per rank
    spec = load_model_spec("configs/qwen3-moe-bench.json")
    planner = Planner(spec, load_cluster("1x2-h100"), make_layout(None, None, 2, False))
    batch = ForwardBatch(torch.zeros(512, dtype=torch.long), [0, 1], [0, 0], [256, 256])
    plan = planner.plan("xbo", OverlapConfig("xbo"), [batch, batch])
    assert len(plan.micro_batches) == 2 and plan.seconds > 0
    # auto: its variant is a candidate, predicted where it fits, chosen when fastest
    assert "xbo4" in MODES.auto_choices() and OverlapConfig(auto_modes=("xbo4",))
    cal = Calibration(1e-9, 0.0, 0.0, 1e-6, 1e9, 1e3, 4, 0.5, 0.0)
    stats = StepStats([1e8, 1e8], [1000, 1000], [1, 1], True, 500)
    choice = choose(cal, stats, 2, ("none", "xbo4"))
    assert set(choice.predicted) == {"none", "xbo4"} and choice.mode == "xbo4"
    # the refusals: its own, and PD multiplexing's
    with pytest.raises(ConfigError, match="xbo refuses --ep 3"):
        check_layout(ParallelConfig(ep=3), None, OverlapConfig("xbo"))
    with pytest.raises(ConfigError, match="does not combine with overlap xbo"):
        check_layout(ParallelConfig(ep=2), None, OverlapConfig("xbo"), pdmux=True)


def test_an_unknown_mode_is_named_with_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="'xbo'.*none.*tbo"):
        OverlapConfig("xbo")
    with pytest.raises(ConfigError, match="mode 'sbo2'"):
        mode_config("sbo2")
    with pytest.raises(ValueError, match="registered already"):
        MODES.register(TBO)
