"""Joining a torchrun launch: rank 0 drives, rank 1 serves, tokens equal one process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from tests.dist_utils import free_port

# Each rank first records what LLM(...) did with a netns link (one launch checks both): had a
# rank exited with the error, torchrun could stop the other before it got that far, and the
# test could not tell what that rank would have done.
SCRIPT = """
import json, os
from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.errors import ConfigError
cfg = ModelConfig.from_hf("configs/deepseek-v3-tiny.json")
try:
    LLM(config=cfg, ep=2, link="netns:1gbit", timeout_s=10).close()
    result = "started"
except ConfigError as exc:
    result = f"ConfigError: {exc}"
with open(f"{OUT}/rank{os.environ['RANK']}.txt", "w") as f:
    f.write(result)
for name, layout in LAYOUTS.items():  # one engine after another in the same processes
    with LLM(config=cfg, overlap="tbo", **layout) as llm:
        params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
        outs = llm.generate(PROMPTS, params)
        with open(f"{OUT}/{name}-rank{os.environ['RANK']}.json", "w") as f:
            json.dump([o.token_ids for o in outs], f)
"""
LAYOUTS = {"ep2": {"ep": 2}, "pp2": {"pp": 2}}
PROMPTS = [[1, 2, 3], list(range(50, 90))]


def _torchrun(script, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_torchrun_two_ranks_match_one_process(tmp_path):
    """An ep2 engine, then a pp2 one in the same launch (each in a world of its own): under
    pp2 the last stage (rank 1) answers for its group, through rank 0's gather. First every
    rank refuses a netns link, which torchrun's processes cannot share, without a hang."""
    script = tmp_path / "run.py"
    head = f"PROMPTS = {PROMPTS!r}\nOUT = {str(tmp_path)!r}\nLAYOUTS = {LAYOUTS!r}\n"
    script.write_text(head + SCRIPT)
    proc = _torchrun(script)  # a hang fails here
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(2):
        refused = (tmp_path / f"rank{r}.txt").read_text()
        assert refused.startswith("ConfigError: --link netns:1gbit cannot be used under torchrun")
    with LLM(config=ModelConfig.from_hf("configs/deepseek-v3-tiny.json")) as llm:
        expected = [
            o.token_ids
            for o in llm.generate(
                PROMPTS, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
            )
        ]
    for name in LAYOUTS:
        results = [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(2)]
        assert results == [expected, []], name  # rank 0 drives; rank 1 served its steps


def test_torchrun_world_must_match_the_layout(monkeypatch):
    from moe_overlap.core.engine_config import EngineSpec
    from moe_overlap.core.errors import ConfigError
    from moe_overlap.core.parallel_config import ParallelConfig
    from moe_overlap.distributed.link import parse_link
    from moe_overlap.runtime.torchrun import TorchrunExecutor

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = ModelConfig.from_hf("configs/deepseek-v3-tiny.json")
    spec = EngineSpec(cfg, parallel=ParallelConfig(tp=4, ep=4))
    with pytest.raises(ConfigError, match="torchrun started 3 processes but tp4 ep4 needs 4"):
        TorchrunExecutor(spec, parse_link("none"), timeout_s=5)
