"""Online EPLB (--enable-eplb) on real gloo ranks: with skewed routing and a rebalance every
three steps, experts move mid-generation, and the greedy tokens are those of the run without
EPLB in every overlap mode (Qwen3-MoE at ep=4 with 6 experts and R = 2, so EP divides only the
slots; DeepSeek-V3's grouped routing at ep=2 with dynamic dispatch, one layer per step
boundary, set through vLLM's --eplb-config with a window of the last 2 steps; GPT-OSS, whose
checkpoint fuses each layer's experts, at ep=2 with R = 2). A peer stuck mid-move is a named timeout that leaves the layer as it was; a rank that
dies mid-move (``MOE_OVERLAP_EPLB_FAULT``) is named by the driver and leaves its peers' layers
as they were; the refusals."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from dataclasses import replace

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.eplb_placement import PlacementShape, trivial
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.link import parse_link
from moe_overlap.engine.online_eplb import eplb_counts
from moe_overlap.runtime.eplb_rebalance import FAULT_ENV, FAULT_EXIT, Rebalancer, expert_tensors
from moe_overlap.runtime.spawn import RankFailure
from moe_overlap.runtime.worker import RankSpec, build_rank_runner
from tests.dist_utils import free_port, init_gloo, run_workers
from tests.helpers import CASES, KW, TINY, every_mode, force_overlap

PARAMS = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SKEW = {"expert_skew": "zipf:2"}  # a few hot experts per layer: the placement really changes
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")
ONLINE = dict(enable_eplb=True, eplb_rebalance_num_iterations=3, **SKEW, **KW)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS)]


def test_experts_move_mid_generation_and_the_tokens_stay():
    prompts = CASES["mixed-batch"]
    runs = {  # family: (engine settings, modes); 6 + 2 slots over 4 ranks, 2 each
        "qwen3_moe": (dict(ep=4, ep_num_redundant_experts=2), MODES),
        "deepseek_v3": (  # vLLM's spelling: R and a window of the last 2 of the 3 steps
            dict(ep=2, eplb_config={"num_redundant_experts": 2, "window_size": 2})
            | dict(ep_dispatch_algorithm="dynamic", eplb_rebalance_layers_per_chunk=1),
            ("none", "tbo+two-chunk"),
        ),
        # its checkpoint's experts fused in one tensor per projection, biases too
        "gpt_oss": (dict(ep=2, ep_num_redundant_experts=2), ("none", "tbo")),
    }
    for family, (settings, modes) in runs.items():
        cfg = (
            ModelConfig.from_hf("configs/gpt-oss-tiny.json")
            if family == "gpt_oss"
            else ModelConfig(**TINY[family] | ({"num_experts": 6} if family == "qwen3_moe" else {}))
        )
        with LLM(config=cfg, **SKEW, **KW) as llm:
            base = _tokens(llm, prompts)
        with LLM(config=cfg, **settings, **ONLINE) as llm:
            assert llm.eplb is not None and llm.spec.placement is not None
            assert llm.eplb.window == (2 if family == "deepseek_v3" else None)
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


def _skewed_rank(rank: int, port: int) -> Rebalancer:
    """Rank ``rank`` of tiny Qwen3-MoE at ep=2 with R = 2, after a forward that routes nearly
    every token to expert 0 (so the next placement moves experts between the ranks)."""
    init_gloo(rank, 2, port, timeout_s=2.0)
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
    return rebalancer


def _survivor(rebalancer: Rebalancer) -> dict:
    """Rank 0's move while its peer fails: the error, and whether layer 0 is as before."""
    block = rebalancer.blocks[0]
    weights = {n: t.clone() for n, t in expert_tensors(block.experts)}
    try:
        rebalancer.step(0)
        error, notes = "", []
    except Exception as e:
        error, notes = f"{type(e).__name__}: {e}", getattr(e, "__notes__", [])
    same = all(torch.equal(weights[n], t) for n, t in expert_tensors(block.experts))
    return {"error": error, "notes": notes, "slots": block.slots, "same": same}


def _dead_peer(rank: int, port: int, pipe: int) -> None:
    """A forked pair of ranks: rank 1 dies after the first expert tensor crossed, rank 0 writes
    what it saw to ``pipe``."""
    try:
        if rank == 1:
            os.environ[FAULT_ENV] = "1:exchange"
            _skewed_rank(rank, port).step(0)  # exits here
        else:
            os.write(pipe, pickle.dumps(_survivor(_skewed_rank(rank, port))))
    finally:
        os._exit(0)


def _failing_peers(rank: int, world_size: int, port: int, port2: int) -> dict:
    """Two pairs of ranks at once: this one, where rank 1 sends its experts too late (stuck),
    and a forked one over ``port2``, where rank 1 dies mid-move."""
    reader, writer = os.pipe()
    pid = os.fork()
    if not pid:
        _dead_peer(rank, port2, writer)
    os.close(writer)
    rebalancer = _skewed_rank(rank, port)
    if rank == 1:  # joins the all-reduce of the window, then sends its experts too late
        rebalancer.pending = rebalancer._plan()
        time.sleep(3.0)
        with contextlib.suppress(RuntimeError):  # rank 0 gave up: its part never comes
            rebalancer.step(0)
        return {"dead": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}
    stuck = _survivor(rebalancer)
    with os.fdopen(reader, "rb") as pipe:
        dead = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    return {"stuck": stuck, "dead": dead}


def test_a_peer_that_fails_mid_move_leaves_the_layer_as_it_was():
    out, peer = run_workers(_failing_peers, 2, free_port(), timeout=60)
    stuck, dead = out["stuck"], out["dead"]
    assert stuck["error"].startswith("CollectiveTimeout: all_to_all")
    assert "did not finish within 2 s" in stuck["error"]
    assert peer["dead"] == FAULT_EXIT and dead["error"]  # rank 1 died mid-move, rank 0 failed
    for failed in (stuck, dead):  # layer 0 as before the move: nothing half committed
        assert failed["slots"] == (0, 1, 2, 3, 0, 1) and failed["same"]
        assert "stopped before its commit" in failed["notes"][0]


def test_a_rank_that_dies_mid_move_is_named(monkeypatch):
    cfg = ModelConfig(**TINY["qwen3_moe"])
    monkeypatch.setenv(FAULT_ENV, "1:exchange")  # the ranks read it: rank 1 dies in a move
    with LLM(config=cfg, ep=2, ep_num_redundant_experts=2, **ONLINE) as llm:
        with pytest.raises(RankFailure) as failed:
            llm.generate(CASES["mixed-batch"], PARAMS)
        assert str(failed.value).startswith(f"rank 1 died (exit code {FAULT_EXIT})")
        assert llm.eplb is not None and llm.eplb.stats.rebalances == 0
        with pytest.raises(RankFailure, match="the engine was stopped"):  # no further step
            llm.generate(CASES["mixed-batch"], PARAMS)


def test_experts_move_under_attention_tp():
    """tp2 ep2: each rank holds whole experts (moe-TP 1), so they move as under pure EP, the
    attention-TP ranks each sending their share of the group's tokens."""
    cfg, prompts = ModelConfig(**TINY["qwen3_moe"] | {"num_experts": 6}), CASES["mixed-batch"]
    with LLM(config=cfg, **SKEW, **KW) as llm:
        base = _tokens(llm, prompts)
    with LLM(config=cfg, tp=2, ep=2, ep_num_redundant_experts=2, **ONLINE) as llm:
        assert llm.eplb is not None
        for mode in ("none", "tbo"):
            force_overlap(llm, every_mode()[mode])
            moved = llm.eplb.stats.slots_moved
            assert _tokens(llm, prompts) == base, mode
            assert llm.eplb.stats.slots_moved > moved, mode


def test_the_mtp_layers_experts_are_placed_and_move_too():
    """Reference 000's scenario has EPLB and MTP at once: DeepSeek-V3's MTP layer is a MoE
    layer of the placement (layer 3 after the model's 1 and 2), its experts move with the
    others', and the speculative greedy tokens are plain greedy decoding's."""
    cfg, prompts = (
        replace(ModelConfig(**TINY["deepseek_v3"]), num_nextn_predict_layers=1),
        [
            [(7 * i) % 80 for i in range(12)],
            [3, 4, 5],
        ],
    )
    with LLM(config=cfg, **SKEW, **KW) as llm:
        base = _tokens(llm, prompts)
    mtp = dict(speculative_algorithm="EAGLE", ep=2, ep_num_redundant_experts=2)
    with LLM(config=cfg, **mtp, **ONLINE) as llm:
        assert llm.spec.placement is not None and llm.spec.placement.moe_layers == (1, 2, 3)
        before = llm.spec.placement.rows
        assert _tokens(llm, prompts) == base
        assert llm.eplb is not None and llm.eplb.stats.slots_moved > 0
        assert llm.spec.placement.rows != before


def test_refusals():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with pytest.raises(ConfigError, match="between expert-parallel ranks: one process"):
        LLM(config=cfg, enable_eplb=True)
    with pytest.raises(ConfigError, match="between expert-parallel ranks: tp2 does not"):
        LLM(config=cfg, tp=2, enable_eplb=True)  # moe-TP 2: each rank a slice of every expert
    with pytest.raises(ConfigError, match="num-iterations=0"):
        LLM(config=cfg, ep=2, enable_eplb=True, eplb_rebalance_num_iterations=0)
    with pytest.raises(ConfigError, match="layers-per-chunk=0"):
        LLM(config=cfg, ep=2, enable_eplb=True, eplb_rebalance_layers_per_chunk=0)
    with pytest.raises(ConfigError, match="--eplb-window-size=0: want an integer >= 1"):
        LLM(config=cfg, ep=2, enable_eplb=True, eplb_window_size=0)
