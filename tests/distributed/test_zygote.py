"""The rank fork server: engines fork their ranks from one server per driver process, which
outlives an engine and is restarted if it dies."""

from __future__ import annotations

from pathlib import Path

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.runtime.zygote import zygote
from tests.helpers import TINY

PARAMS = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_engines_fork_their_ranks_from_one_server_that_is_restarted_if_it_dies():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    server = zygote()
    with LLM(config=cfg, ep=2, seed=0) as llm:
        first = llm.generate([[1, 2, 3]], PARAMS)[0].token_ids
        ranks = [p.proc.pid for p in llm.executor.procs]
        assert [_parent(pid) for pid in ranks] == [server.proc.pid] * 2
        assert Path(f"/proc/{ranks[0]}/cwd").resolve() == Path.cwd().resolve()
    assert zygote() is server and server.alive()  # kept for the next engine
    assert all(not Path(f"/proc/{pid}").exists() for pid in ranks)  # exited and reaped
    server.proc.kill()
    server.proc.wait(10)
    with LLM(config=cfg, ep=2, seed=0) as llm:
        assert llm.generate([[1, 2, 3]], PARAMS)[0].token_ids == first
        assert _parent(llm.executor.procs[0].proc.pid) == zygote().proc.pid != server.proc.pid
