"""Expert parallelism on real gloo ranks: same logits and tokens as one process, faults, links."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.runtime.spawn import RankFailure
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, reference


@pytest.fixture(scope="module", params=sorted(TINY))
def family(request):
    cfg = ModelConfig(**TINY[request.param])
    return cfg, reference(cfg)


@pytest.mark.parametrize(
    "overlap",
    ["none", "tbo", OverlapConfig("tbo", tbo_token_distribution_threshold=0)],
    ids=["none", "tbo+two-chunk", "tbo"],
)
def test_ep2_matches_one_process(family, overlap):
    cfg, base = family
    with LLM(config=cfg, ep=2, overlap=overlap, **KW) as llm:
        for case, prompts in CASES.items():
            assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


def test_ep4_matches_one_process():
    cfg = ModelConfig(**TINY["deepseek_v3"])
    base = reference(cfg)
    with LLM(config=cfg, ep=4, overlap="tbo", **KW) as llm:
        for case in ("mixed-batch", "single-long"):
            assert_same(base[case], llm.generate(CASES[case], PARAMS, return_logits=True))


def test_layout_refusals():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with pytest.raises(ConfigError, match="--ep=3 must divide num_experts=4"):
        LLM(config=cfg, ep=3)
    with pytest.raises(ConfigError, match="--enable-dbo needs more than one rank"):
        LLM(config=cfg, overlap="dbo")
    with pytest.raises(
        ConfigError,
        match="--moe-a2a-backend=local holds every expert on one rank; with dp2 dp-attention ep2",
    ):
        LLM(config=cfg, ep=2, overlap=OverlapConfig("tbo", moe_a2a_backend="local"))
    with pytest.raises(ConfigError, match=r"needs more than one rank \(--ep or --tp > 1\)"):
        LLM(config=cfg, link="model:1gbit,10us")


def _alive(llm):
    return [p.proc.poll() is None for p in llm.executor.procs]


@pytest.mark.parametrize("layout", [{"ep": 2}, {"pp": 2}], ids=["ep2", "pp2-stage"])
def test_killed_rank_stops_everything_with_its_name(layout):
    cfg = ModelConfig(**{**TINY["qwen3_moe"], "max_position_embeddings": 4096})
    llm = LLM(config=cfg, timeout_s=10, **layout, **KW)
    victim = llm.executor.procs[1].proc
    killer = threading.Timer(1.0, victim.kill)
    killer.start()
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died \(exit code -9\)"):
        llm.generate(
            [[1, 2, 3]] * 4, SamplingParams(temperature=0, max_new_tokens=2000, ignore_eos=True)
        )
    assert time.monotonic() - start < 30
    assert not any(_alive(llm))
    with pytest.raises(RankFailure, match="stopped"):
        llm.generate([[1, 2]], PARAMS)
    llm.close()


def test_rank_killed_while_idle_is_named_at_the_next_step():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    llm = LLM(config=cfg, ep=2, timeout_s=10, **KW)
    llm.generate([[1, 2, 3]], PARAMS)
    victim = llm.executor.procs[1].proc
    victim.kill()
    victim.wait(10)
    with pytest.raises(RankFailure, match=r"rank 1 died \(exit code -9\)"):
        llm.generate([[1, 2, 3]] * 4, PARAMS)
    assert not any(_alive(llm))
    llm.close()


def test_raising_rank_is_named_and_others_stop():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with LLM(config=cfg, ep=2, timeout_s=10, **KW) as llm:
        # a batch whose KV slot does not exist on rank 1 makes it raise
        from moe_overlap.core.batch import ForwardBatch

        ok = ForwardBatch(torch.tensor([1, 2]), [0], [0], [2])
        bad = ForwardBatch(torch.tensor([1, 2]), [10_000], [0], [2])
        with pytest.raises(RankFailure, match="rank 1 raised IndexError"):
            llm.executor.run([ok, bad])
        assert not any(_alive(llm))


def _netns_permitted() -> str | None:
    from moe_overlap.distributed.netns import LinkUnavailable, NetnsLink

    try:
        with NetnsLink(2, "1gbit"):
            return None
    except (LinkUnavailable, OSError) as exc:
        return str(exc)


def test_ep2_over_shaped_netns_link_and_cleanup():
    why = _netns_permitted()
    if why:
        pytest.skip(f"network namespaces are not permitted here: {why}")
    cfg = ModelConfig(**TINY["deepseek_v3"])
    base = reference(cfg)
    with LLM(config=cfg, ep=2, overlap="tbo", link="netns:500mbit", **KW) as llm:
        names = [llm.executor.netns.netns_name(r) for r in range(2)]
        assert_same(
            base["mixed-batch"], llm.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
        )
        llm.executor.procs[0].proc.kill()  # and a crash still cleans the namespaces up
        with pytest.raises(RankFailure, match="rank 0 died"):
            llm.generate([[1, 2, 3]], PARAMS)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def test_ep2_over_modelled_link():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    base = reference(cfg)
    with LLM(config=cfg, ep=2, link="model:1gbit,50us", **KW) as llm:
        assert_same(
            base["short+long"], llm.generate(CASES["short+long"], PARAMS, return_logits=True)
        )
