"""Joining a torchrun launch: rank 0 drives, rank 1 serves, tokens equal one process."""

from __future__ import annotations

import json
import subprocess
import sys

from moe_overlap import LLM, ModelConfig, SamplingParams
from tests.dist_utils import free_port

SCRIPT = """
import json, os
from moe_overlap import LLM, ModelConfig, SamplingParams
cfg = ModelConfig.from_hf("configs/deepseek-v3-tiny.json")
with LLM(config=cfg, ep=2, overlap="tbo") as llm:
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))
    with open(f"{OUT}/rank{os.environ['RANK']}.json", "w") as f:
        json.dump([o.token_ids for o in outs], f)
"""
PROMPTS = [[1, 2, 3], list(range(50, 90))]


def test_torchrun_two_ranks_match_one_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(f"PROMPTS = {PROMPTS!r}\nOUT = {str(tmp_path)!r}\n{SCRIPT}")
    proc = subprocess.run(
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
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    with LLM(config=ModelConfig.from_hf("configs/deepseek-v3-tiny.json")) as llm:
        expected = [
            o.token_ids
            for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=5, ignore_eos=True))
        ]
    assert results == [expected, []]  # rank 0 drives; rank 1 served its steps
