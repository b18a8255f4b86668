"""EPLB's redundant experts on real gloo ranks: whichever replica serves a token, the logits
are those of the run without redundancy, in every overlap mode, static and dynamic dispatch,
for Qwen3-MoE and DeepSeek-V3 (grouped routing); and the engine's refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.eplb_placement import PlacementShape, rebalance
from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.link import parse_link
from moe_overlap.runtime.worker import RankSpec, build_rank_runner
from tests.dist_utils import init_gloo, run_workers
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, every_mode

MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")
LOW_LATENCY = "none+low-latency"
SIX = "qwen3_moe, 6 experts"  # the fixed-capacity all-to-all (pure EP only)
# four ranks: pure ep=4 (all-to-all) for both families, and ep=2 under tp=4 with attention DP
# (each expert's width split two ways: the tensor-parallel MoE's gather) for DeepSeek-V3, each
# with the R that divide (pure ep=2 over the all-to-all: the engine test below; R = 2 at ep=4:
# six experts, in the worker)
LAYOUTS = {
    4: (ParallelConfig(ep=4), (4, 8), ("qwen3_moe", "deepseek_v3")),
    2: (ParallelConfig(tp=4, dp=4, ep=2, enable_dp_attention=True), (2, 4), ("deepseek_v3",)),
}


def _placement(cfg: ModelConfig, ep: int, redundant: int, dispatch: str) -> ExpertPlacement:
    # a skewed load per layer, so the hot experts get the replicas
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    rng = random.Random(redundant)
    load = [[1000 / (rng.random() + e) ** 1.5 for e in range(1, cfg.num_experts + 1)]]
    shape = PlacementShape(cfg.num_experts, cfg.num_experts + redundant, ep)
    rows = rebalance([rng.sample(load[0], len(load[0])) for _ in layers], shape)
    return ExpertPlacement(tuple(layers), tuple(tuple(r) for r in rows), dispatch)


def _runs(fewer: int, more: int) -> list[tuple[int, str, tuple[str, ...]]]:
    # every mode at each R and each dispatch, within the test-time budget: the full grid
    # less the two corners that repeat what their row and column show
    return [
        (0, "-", ("none",)),
        (fewer, "static", MODES),
        (more, "dynamic", MODES),
        (fewer, "dynamic", ("none", "tbo+two-chunk")),
        (more, "static", ("none", "sbo", LOW_LATENCY)),
    ]


def _worker(rank: int, world_size: int, port: int) -> dict:
    init_gloo(rank, world_size, port)
    gen = torch.Generator().manual_seed(rank)
    lengths = [9, 14, 5] if rank == 0 else [11, 6]
    batch = ForwardBatch(
        torch.randint(1, 60, (sum(lengths),), generator=gen),
        list(range(len(lengths))),
        [0] * len(lengths),
        lengths,
    )
    modes = {m: every_mode()[m] for m in MODES}
    modes[LOW_LATENCY] = OverlapConfig(a2a_mode="low_latency", num_max_dispatch_tokens_per_rank=32)
    out = {}
    runs = [(ep, par, r, f) for ep, (par, r, families) in LAYOUTS.items() for f in families]
    for ep, par, redundants, family in runs:
        cfg = ModelConfig(**TINY[family])
        for redundant, dispatch, mode_names in _runs(*redundants):
            runner = _runner(rank, cfg, par, redundant, dispatch)
            for mode in mode_names if ep == 4 else set(mode_names) - {LOW_LATENCY}:
                out[ep, family, redundant, dispatch, mode] = runner.forward(batch, modes[mode])
    # R = 2 at ep=4: Qwen3-MoE with 6 experts (EP divides the 8 slots, not the experts),
    # against one process
    cfg = ModelConfig(**TINY["qwen3_moe"] | {"num_experts": 6})
    one = build_rank_runner(EngineSpec(cfg, seed=0, max_num_seqs=4, max_len=64))
    out[4, SIX, 0, "-", "none"] = one.forward(batch, modes["none"])
    for dispatch, mode_names in (("static", MODES), ("dynamic", ("none", "dbo"))):
        runner = _runner(rank, cfg, ParallelConfig(ep=4), 2, dispatch)
        for mode in mode_names:
            out[4, SIX, 2, dispatch, mode] = runner.forward(batch, modes[mode])
    return out


def _runner(rank: int, cfg: ModelConfig, par: ParallelConfig, redundant: int, dispatch: str):
    placement = _placement(cfg, par.ep, redundant, dispatch) if redundant else None
    spec = EngineSpec(cfg, seed=0, max_num_seqs=4, max_len=64, parallel=par, placement=placement)
    return build_rank_runner(spec, RankSpec(rank, 4, "", 30.0, parse_link("none")))


def test_redundant_experts_give_the_same_logits():
    for rank, out in enumerate(run_workers(_worker, 4, timeout=180)):
        assert len(out) == 3 * (5 + 2 * len(MODES)) + 2 + 8  # low-latency at ep=4; SIX
        for (ep, family, redundant, dispatch, mode), logits in out.items():
            base = out[ep, family, 0, "-", "none"]
            diff = (logits - base).abs().max().item()
            assert diff <= 1e-4, (rank, ep, family, redundant, dispatch, mode, diff)


def test_engine_generates_the_same_tokens_and_refuses_bad_settings(tmp_path):
    cfg = ModelConfig(**TINY["qwen3_moe"])
    prompts = CASES["mixed-batch"]
    skew = {"expert_skew": "zipf:3"}  # a hot expert per layer: EPLB has something to fix
    with LLM(config=cfg, **skew, **KW) as llm:
        llm.start_expert_distribution_record()
        base = llm.generate(prompts, PARAMS, return_logits=True)
        recorded = llm.expert_distribution()
    tokens = sum(len(p) for p in prompts) + len(prompts) * (PARAMS.max_new_tokens - 1)
    top_k = cfg.num_experts_per_tok
    assert [sum(layer) for layer in recorded.load] == [tokens * top_k] * cfg.num_hidden_layers
    # the skew: one expert in every token's top 2 (unskewed, the top expert here takes < 0.4)
    assert all(max(layer) == tokens for layer in recorded.load), recorded.load
    # a distribution placed at start-up, pure ep=2 over the all-to-all, TBO
    dist = tmp_path / "load.json"
    dist.write_text(json.dumps({"load": [[50, 900, 10, 40]] * cfg.num_hidden_layers}))
    eplb = dict(ep_num_redundant_experts=2, init_expert_location=str(dist))
    eplb |= {"ep_dispatch_algorithm": "dynamic", **skew}
    with LLM(config=cfg, ep=2, overlap="tbo", **eplb, **KW) as llm:
        assert llm.spec.placement is not None and llm.spec.placement.rows[0].count(1) == 2
        llm.start_expert_distribution_record()
        assert_same(base, llm.generate(prompts, PARAMS, return_logits=True))
        llm.stop_expert_distribution_record()
        llm.generate(prompts[:1], PARAMS)  # not counted
        spread = llm.expert_distribution()
    # the same routing, whichever replica served it, now spread over two ranks
    assert spread.load == recorded.load
    assert all(len(r) == 2 and sum(r) == tokens * top_k for r in spread.rank_load)
    assert recorded.balancedness == [1.0, 1.0] and all(b < 1 for b in spread.balancedness)
    with pytest.raises(ConfigError, match="two replicas of one expert on rank 0"):
        LLM(config=cfg, ep_num_redundant_experts=2)
    with pytest.raises(ConfigError, match="= 5 physical expert slots; choose .* 2 plus"):
        LLM(config=cfg, ep=2, ep_num_redundant_experts=1)
    with pytest.raises(ConfigError, match="must be an integer >= 0"):
        LLM(config=cfg, ep=2, ep_num_redundant_experts=-2)
    with pytest.raises(ConfigError, match="want zipf:S"):
        LLM(config=cfg, expert_skew="pareto:2")
    with pytest.raises(ConfigError, match="init-expert-location .*nope.json"):
        LLM(config=cfg, ep=2, init_expert_location=str(tmp_path / "nope.json"))
