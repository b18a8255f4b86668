"""Online EPLB (--enable-eplb) on real gloo ranks: with skewed routing and a rebalance every
three steps, experts move mid-generation, and the greedy tokens are those of the run without
EPLB in every overlap mode (Qwen3-MoE at ep=2; DeepSeek-V3's grouped routing at ep=2 with
dynamic dispatch, one layer per step boundary). A peer stuck mid-move is a named timeout that leaves the layer as it was;
a dead rank is named; the refusals."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.eplb_placement import PlacementShape, trivial
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.comm import CollectiveTimeout
from moe_overlap.distributed.link import parse_link
from moe_overlap.engine.online_eplb import eplb_counts
from moe_overlap.runtime.eplb_rebalance import Rebalancer, expert_tensors
from moe_overlap.runtime.spawn import RankFailure
from moe_overlap.runtime.worker import RankSpec, build_rank_runner
from tests.dist_utils import init_gloo, run_workers
from tests.helpers import CASES, KW, TINY, every_mode, force_overlap

PARAMS = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SKEW = {"expert_skew": "zipf:2"}  # a few hot experts per layer: the placement really changes
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")
ONLINE = dict(enable_eplb=True, eplb_rebalance_num_iterations=3, **SKEW, **KW)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def test_experts_move_mid_generation_and_the_tokens_stay():
    prompts = CASES["mixed-batch"]
    runs = {  # family: (engine settings, modes)
        "qwen3_moe": (dict(ep=2, ep_num_redundant_experts=2), MODES),
        "deepseek_v3": (
            dict(ep=2, ep_num_redundant_experts=2, ep_dispatch_algorithm="dynamic")
            | dict(eplb_rebalance_layers_per_chunk=1),
            ("none", "tbo+two-chunk"),
        ),
    }
    for family, (settings, modes) in runs.items():
        cfg = ModelConfig(**TINY[family])
        with LLM(config=cfg, **SKEW, **KW) as llm:
            base = _tokens(llm, prompts)
        with LLM(config=cfg, **settings, **ONLINE) as llm:
            assert llm.eplb is not None and llm.spec.placement is not None
            before = llm.spec.placement.rows
            for mode in modes:
                force_overlap(llm, every_mode()[mode])
                moved = llm.eplb.stats.slots_moved
                assert _tokens(llm, prompts) == base, (family, mode)
                assert llm.eplb.stats.slots_moved > moved, (family, mode)  # moved mid-run
            stats = llm.eplb.stats
            assert llm.spec.placement.rows != before and stats.bytes_moved > 0
            assert stats.rebalances >= len(modes) and stats.layers_moved >= stats.rebalances
            assert eplb_counts(llm.eplb)["eplb_bytes_moved"] == stats.bytes_moved  # /metrics
            if family == "qwen3_moe":  # a rank that died is named, no hang
                os.kill(llm.executor.procs[1].proc.pid, signal.SIGKILL)
                with pytest.raises(RankFailure, match="rank 1"):
                    llm.executor.rebalance_experts(0)


def _stuck_peer(rank: int, world_size: int, port: int) -> dict:
    init_gloo(rank, world_size, port, timeout_s=2.0)
    cfg = ModelConfig(**TINY["qwen3_moe"])
    shape = PlacementShape(cfg.num_experts, cfg.num_experts + 2, 2)
    layers = (0, 1)
    placement = ExpertPlacement(layers, (tuple(trivial(shape)),) * 2, "static", shape)
    par = ParallelConfig(ep=2)
    spec = EngineSpec(cfg, seed=0, max_num_seqs=2, max_len=64, parallel=par, placement=placement)
    runner = build_rank_runner(spec, RankSpec(rank, 2, "", 2.0, parse_link("none")))
    rebalancer = Rebalancer.of(runner.model, runner.group, placement)
    assert rebalancer is not None
    for block in rebalancer.blocks.values():  # expert 0 hot: the placement changes
        block.gate.set_skew(torch.tensor([0.0, -9, -9, -9]))
    runner.forward(ForwardBatch(torch.arange(1, 13), [0], [0], [12]))
    if rank == 1:  # joins the all-reduce of the window, then sends its experts too late
        rebalancer.pending = rebalancer._plan()
        time.sleep(3.0)
        with contextlib.suppress(RuntimeError):  # rank 0 gave up: its part never comes
            rebalancer.step(0)
        return {}
    block = rebalancer.blocks[0]
    weights = {n: t.clone() for n, t in expert_tensors(block.experts)}
    try:
        rebalancer.step(0)
        error = ""
    except CollectiveTimeout as e:
        error = str(e)
    same = all(torch.equal(weights[n], t) for n, t in expert_tensors(block.experts))
    return {"error": error, "slots": block.slots, "same": same}


def test_a_stuck_peer_mid_move_is_a_named_timeout_and_no_layer_half_moves():
    out = run_workers(_stuck_peer, 2, timeout=60)[0]
    assert "all_to_all" in out["error"] and "did not finish within 2 s" in out["error"]
    assert out["slots"] == (0, 1, 2, 3, 0, 1) and out["same"]  # as before the move


def test_refusals():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with pytest.raises(ConfigError, match="pure expert"):
        LLM(config=cfg, enable_eplb=True)
    with pytest.raises(ConfigError, match="pure expert"):
        LLM(config=cfg, tp=2, ep=2, enable_eplb=True)
    with pytest.raises(ConfigError, match="num-iterations=0"):
        LLM(config=cfg, ep=2, enable_eplb=True, eplb_rebalance_num_iterations=0)
    with pytest.raises(ConfigError, match="layers-per-chunk=0"):
        LLM(config=cfg, ep=2, enable_eplb=True, eplb_rebalance_layers_per_chunk=0)
