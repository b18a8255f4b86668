"""``--a2a-mode low_latency``: fixed-capacity all-to-alls give the normal dispatch's logits in
every overlap mode, on real gloo ranks (ep=2 for every family, ep=4 for one), refuse what would
overflow a block before sending it, and take the flags SGLang and vLLM spell it with."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig, SamplingParams
from moe_overlap.core.a2a_mode import step_a2a_mode
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.link import parse_link
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.runtime.spawn import RankFailure
from moe_overlap.runtime.worker import RankSpec, build_rank_runner
from tests.dist_utils import init_gloo, run_workers
from tests.helpers import TINY, assert_same, every_mode

FAMILIES = {f: lambda f=f: ModelConfig(**TINY[f]) for f in TINY} | {
    name: lambda name=name: ModelConfig.from_hf(f"configs/{name}-tiny.json")
    for name in ("gpt-oss", "glm4-moe", "mimo-v2-flash", "qwen3_5-moe")
}
CAP_FLAG = "num_max_dispatch_tokens_per_rank"
CAP = 24  # tokens per rank per micro-batch: every batch below fits


def _prefill(lengths: list[int], first_slot: int = 0, seed: int = 0) -> ForwardBatch:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 60, (sum(lengths),), generator=gen)
    slots = list(range(first_slot, first_slot + len(lengths)))
    return ForwardBatch(ids, slots, [0] * len(lengths), lengths)


def _decode(slots: list[int], prefixes: list[int]) -> ForwardBatch:
    n = len(slots)
    ids = torch.arange(3, 3 + n)
    return ForwardBatch(ids, slots, prefixes, [1] * n, is_decode=[True] * n)


def _both_ways(llm: LLM, steps: list[list[ForwardBatch]]) -> None:
    """Each step through every mode, once per dispatch: the same logits on every rank. A
    step rewrites the cache rows it reads, so both dispatches see the same cache."""
    for mode, overlap in every_mode().items():
        for batches in steps:
            got = {}
            for a2a in ("normal", "low_latency"):
                cfg = replace(overlap, a2a_mode=a2a, num_max_dispatch_tokens_per_rank=CAP)
                got[a2a] = llm.executor.run(batches, cfg).logits
            for rank, (a, b) in enumerate(zip(got["normal"], got["low_latency"], strict=True)):
                assert a.shape == b.shape, (mode, rank)
                assert (a - b).abs().max().item() <= 1e-4 if a.numel() else True, (mode, rank)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_low_latency_equals_normal_at_ep2_in_every_mode(family):
    cfg = FAMILIES[family]()
    with LLM(config=cfg, ep=2, seed=0, max_num_seqs=6, max_model_len=64) as llm:
        prompts = [_prefill([9, 14], seed=1), _prefill([3, 5, 11], seed=2)]  # different per rank
        llm.executor.run(prompts)  # the context the decode steps read
        steps = [
            [_prefill([7, 12], first_slot=3, seed=3), _prefill([20], first_slot=4, seed=4)],
            [_decode([0, 1], [9, 14]), _decode([0, 1, 2], [3, 5, 11])],
            [_decode([0, 1], [9, 14]), ForwardBatch.idle()],  # an idle rank still sends blocks
        ]
        # a recurrent state cannot run the same decode step twice: prompts only (from 0)
        _both_ways(llm, steps[:1] if cfg.is_hybrid else steps)


def test_low_latency_equals_normal_at_ep4():
    cfg = ModelConfig(**TINY["deepseek_v3"])  # 8 experts: two per rank
    with LLM(config=cfg, ep=4, seed=0, max_num_seqs=4, max_model_len=48) as llm:
        lengths = [[6, 9], [13], [2, 4, 7], [10]]
        llm.executor.run([_prefill(n, seed=r) for r, n in enumerate(lengths)])
        decode = [_decode(list(range(len(n))), n) for n in lengths]
        _both_ways(llm, [decode])


@pytest.mark.parametrize(
    ("family", "layout"),
    [("qwen3_moe", dict(tp=2, ep=2)), ("deepseek_v3", dict(tp=4, ep=4, dp=2))],
)
def test_low_latency_equals_normal_under_attention_tp(family, layout):
    """Each attention-TP rank sends its share of the group's tokens in fixed blocks and the
    group gathers the combined rows (SGLang's --tp 8 --ep 8 with DeepEP): tp2 ep2, and two
    DP-attention groups of attention TP 2 over ep4."""
    cfg = ModelConfig(**TINY[family])
    dp = layout.get("dp", 1)
    with LLM(config=cfg, **layout, enable_dp_attention=dp > 1, seed=0, max_model_len=64) as llm:
        lengths = [[9, 14], [3, 5, 11]][:dp]
        llm.executor.run([_prefill(n, seed=g) for g, n in enumerate(lengths)])
        decode = [_decode(list(range(len(n))), n) for n in lengths]
        # 40 tokens: over the capacity of 24 for one rank, within it for each one's share
        _both_ways(llm, [[_prefill([40], first_slot=3, seed=3)] * dp, decode])


def test_the_references_launch_line_runs_qwen3_5():
    """Reference 000's `--tp 8 --ep 8 --enable-two-batch-overlap --moe-a2a-backend
    deepep_low_latency` on Qwen3.5, at tp2 ep2: the one-process tokens and logits."""
    cfg, prompts = FAMILIES["qwen3_5-moe"](), [[5, 9, 2, 40, 7], [3] * 11]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with LLM(config=cfg, seed=0, max_model_len=64) as llm:
        base = llm.generate(prompts, params, return_logits=True)
    line = dict(tp=2, ep=2, enable_two_batch_overlap=True, moe_a2a_backend="deepep_low_latency")
    with LLM(config=cfg, seed=0, max_model_len=64, max_num_batched_tokens=256, **line) as llm:
        assert llm.args.overlap_config().a2a_mode == "low_latency"
        assert_same(base, llm.generate(prompts, params, return_logits=True))


def test_auto_takes_low_latency_only_for_decode_steps_that_fit():
    decode, prefill = _decode([0, 1], [4, 4]), _prefill([5])
    idle = ForwardBatch.idle()
    assert step_a2a_mode("auto", [decode, idle], 8, True) == "low_latency"
    assert step_a2a_mode("auto", [decode, prefill], 8, True) == "normal"  # one rank prefills
    assert step_a2a_mode("auto", [decode], 1, True) == "normal"  # over the capacity
    assert step_a2a_mode("auto", [decode], 8, False) == "normal"  # the layout has none
    assert step_a2a_mode("auto", [idle, idle], 8, True) == "normal"
    assert step_a2a_mode("low_latency", [prefill], 8, True) == "low_latency"


def test_a_step_over_the_capacity_is_refused_before_anything_is_sent():
    with pytest.raises(ConfigError, match="--num-max-dispatch-tokens-per-rank=4"):
        step_a2a_mode("low_latency", [_prefill([3]), _prefill([5])], 4, True)
    with pytest.raises(ConfigError, match="needs the all-to-all dispatcher"):
        step_a2a_mode("low_latency", [_prefill([3])], 4, False)
    # under attention TP 2 each rank sends at most 4 of the 7 tokens: they fit
    assert step_a2a_mode("low_latency", [_prefill([7])], 4, True, share=2) == "low_latency"
    with pytest.raises(ConfigError, match="a dispatch of 5 tokens"):
        step_a2a_mode("low_latency", [_prefill([9])], 4, True, share=2)


def test_the_capacity_bounds_each_micro_batch_as_deepep_bounds_each_dispatch_call():
    """4 decodes a rank fit a capacity of 2 where TBO or DBO cuts them in two (each
    micro-batch dispatches on its own, as SGLang's TBO calls DeepEP's low-latency dispatch
    once per micro-batch), and give the normal dispatch's logits; unsplit they are refused."""
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with LLM(config=cfg, ep=2, seed=0, max_num_seqs=4, max_model_len=32) as llm:
        lengths = [[5, 6, 7, 8], [4, 9, 3, 6]]
        llm.executor.run([_prefill(n, seed=r) for r, n in enumerate(lengths)])
        step = [_decode(list(range(4)), n) for n in lengths]
        modes = every_mode()
        for mode in ("tbo", "dbo"):
            got = [
                llm.executor.run(step, replace(modes[mode], a2a_mode=a2a, **{CAP_FLAG: 2}))
                for a2a in ("normal", "low_latency")
            ]
            for a, b in zip(got[0].logits, got[1].logits, strict=True):
                assert (a - b).abs().max().item() <= 1e-4, mode
        # unsplit, the same step is refused on the ranks before any row is sent
        unsplit = replace(modes["none"], a2a_mode="low_latency", **{CAP_FLAG: 2})
        with pytest.raises(RankFailure, match="dispatch of 4 tokens .*tokens-per-rank=2"):
            llm.executor.run(step, unsplit)


def test_engine_settings_that_could_overflow_are_refused():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with pytest.raises(ConfigError, match="--max-num-batched-tokens=8192 lets a step send more"):
        LLM(config=cfg, ep=2, a2a_mode="low_latency")
    with pytest.raises(ConfigError, match=r"over attention TP 2\); lower it to 256"):
        LLM(config=cfg, tp=2, ep=2, a2a_mode="low_latency", max_num_batched_tokens=257)
    with pytest.raises(ConfigError, match="needs expert-parallel ranks"):
        LLM(config=cfg, a2a_mode="low_latency", max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="not the tensor-parallel MoE"):
        LLM(config=cfg, tp=2, ep=1, a2a_mode="low_latency", max_num_batched_tokens=64)


def test_sglang_and_vllm_spellings():
    assert EngineArgs.from_kwargs(deepep_mode="low_latency").overlap_config().a2a_mode == (
        "low_latency"
    )
    for vllm, ours in (("deepep_low_latency", "low_latency"), ("deepep_high_throughput", "normal")):
        args = EngineArgs.from_kwargs(all2all_backend=vllm)
        assert args.overlap_config().a2a_mode == ours
    with pytest.raises(ConfigError, match="--a2a-mode='pplx' must be one of auto, normal"):
        EngineArgs.from_kwargs(all2all_backend="pplx").overlap_config()
    # SGLang's --moe-a2a-backend deepep, and the batch-overlap reference's names with the layout
    for backend, mode, want in (
        ("deepep", "low_latency", "low_latency"),
        ("deepep_low_latency", "auto", "low_latency"),
        ("deepep_normal", "normal", "normal"),
    ):
        args = EngineArgs.from_kwargs(moe_a2a_backend=backend, deepep_mode=mode)
        assert (args.overlap_config().moe_a2a_backend, args.overlap_config().a2a_mode) == (
            "torch",
            want,
        )
    with pytest.raises(ConfigError, match="names the low_latency layout but --a2a-mode is normal"):
        EngineArgs.from_kwargs(
            moe_a2a_backend="deepep_low_latency", a2a_mode="normal"
        ).overlap_config()


def _deferred_worker(rank, world_size, port):
    """Each mode with the normal dispatch sending its rows when first waited for (CUDA's
    order, forced here on gloo) against sending them at once."""
    init_gloo(rank, world_size, port)
    cfg = ModelConfig(**TINY["deepseek_v3"])
    spec = EngineSpec(
        cfg, seed=0, max_num_seqs=4, max_len=64, parallel=ParallelConfig(ep=world_size)
    )
    runner = build_rank_runner(spec, RankSpec(rank, world_size, "", 30.0, parse_link("none")))
    batch = _prefill([9, 14] if rank == 0 else [5], seed=rank)
    out = {}
    for mode, overlap in every_mode().items():
        for defer in (False, True):
            runner.dispatcher.defer_send = defer
            out[mode, defer] = runner.forward(batch, replace(overlap, a2a_mode="normal"))
    return out


def test_the_deferred_send_gives_the_same_logits_at_ep2():
    for out in run_workers(_deferred_worker, 2):
        for mode in every_mode():
            assert torch.equal(out[mode, True], out[mode, False]), mode
