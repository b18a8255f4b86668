"""Decode from CUDA graphs, everything but the capture: the padded, buffer-fed forward a graph
holds (``DecodeGraphs(capture=False)`` runs it eagerly) gives the eager decode's logits, and its
padding rows write only the scratch slot. The capture itself runs in tests/gpu."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.runtime.cuda_graphs import DecodeGraphs
from moe_overlap.runtime.graph_buckets import graph_sizes, key_bucket
from moe_overlap.runtime.rank import build_rank_runner
from tests.helpers import TINY, max_abs_diff

SLOTS, LENGTHS = [0, 2, 5], [3, 40, 300]
DBO = OverlapConfig(
    "dbo", dbo_decode_token_threshold=1
)  # micro-batches from 2 tokens on  # one context past the shortest key bucket (256)


def test_sizes_and_key_buckets():
    assert graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_sizes(3) == [1, 2, 3]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert [key_bucket(n, 4096) for n in (1, 256, 257, 3000, 4096)] == [256, 256, 512, 4096, 4096]
    assert key_bucket(300, 400) == 400  # never past max_len


# the tiny families, and the two whose sliding windows (128 keys) the 300-token context crosses
MODELS = {f: lambda f=f: ModelConfig(**TINY[f]) for f in TINY} | {
    name: lambda name=name: ModelConfig.from_hf(f"configs/{name}-tiny.json")
    for name in ("gpt-oss", "mimo-v2-flash")
}


def eager_graphs(runner, max_bs: int, local: bool = True) -> DecodeGraphs:
    """``runner``'s decode graphs, each running its padded, buffer-fed forward eagerly
    (``local``: one rank's dispatch; else the low-latency one's steps)."""
    return DecodeGraphs(
        runner.model,
        runner.kv_cache,
        runner.forward_stage,
        max_bs,
        capture=False,
        mode_ran=lambda: runner.last_mode,
        local=local,
    )


def _prefilled(family: str):
    cfg = MODELS[family]()
    # one slot more than the sequences use: the last is the graphs' scratch slot
    runner = build_rank_runner(EngineSpec(cfg, seed=0, max_num_seqs=7, max_len=600))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (sum(LENGTHS),), generator=gen)
    runner.forward(ForwardBatch(ids, SLOTS, [0, 0, 0], LENGTHS))
    return runner, cfg


@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_padded_buffer_fed_decode_gives_the_eager_logits(family):
    runner, cfg = _prefilled(family)
    graphs = eager_graphs(runner, 4)
    step = ForwardBatch(torch.tensor([7, 8, 9]), SLOTS, LENGTHS, [1, 1, 1], is_decode=[True] * 3)
    before = {k: v.clone() for k, v in runner.kv_cache.layers[0].items()}
    for overlap in (OverlapConfig("none"), OverlapConfig("tbo", tbo_min_tokens=1), DBO):
        eager = runner.forward(step, overlap)
        runner.graphs = graphs
        assert graphs.covers([step], overlap, False)
        replayed = runner.forward(step, overlap)
        runner.graphs = None
        assert runner.last_mode == overlap.mode  # TBO and DBO did cut the padded batch
        assert replayed.shape == eager.shape == (3, cfg.vocab_size)
        assert max_abs_diff(replayed, eager) <= 1e-4
        assert torch.equal(replayed.argmax(-1), eager.argmax(-1))
    # the batch of 3 ran in the graph of 4: the padding row wrote the scratch page only
    assert {(k[0].size, k[0].width, k[0].keys) for k in graphs.graphs} == {(4, 1, 512)}
    kv = runner.kv_cache
    written = {p for slot in [*SLOTS, graphs.scratch] for p in kv.held[slot]}
    untouched = [p for p in range(kv.num_pages + 1) if p not in written]
    assert len(kv.held[graphs.scratch]) == 1 and len(untouched) > kv.num_pages // 2
    for name, pages in before.items():
        assert torch.equal(kv.layers[0][name][untouched], pages[untouched])
    assert kv.layers[0][name].shape[0] == kv.num_pages + 1  # allocated whole


def test_prefill_and_other_modes_stay_eager():
    runner, _ = _prefilled("qwen3_moe")
    graphs = eager_graphs(runner, 2)
    decode = ForwardBatch(torch.tensor([1, 2, 3]), SLOTS, LENGTHS, [1, 1, 1], is_decode=[True] * 3)
    assert not graphs.covers([decode], OverlapConfig("none"), False)  # 3 sequences > max_bs 2
    prefill = ForwardBatch(torch.tensor([1, 2]), [1], [0], [2])
    assert not graphs.covers([prefill], OverlapConfig("none"), False)
    two = ForwardBatch(torch.tensor([1, 2]), SLOTS[:2], LENGTHS[:2], [1, 1], is_decode=[True] * 2)
    assert graphs.covers([two], OverlapConfig("none"), False)  # a decode batch that fits...
    assert not graphs.covers([two], OverlapConfig("sbo"), False)  # ...in a mode no graph holds
    cpu = torch.device("cpu")
    assert DecodeGraphs.supported(runner.model, cpu, runner.dispatcher, False) == (
        "CUDA graphs run on CUDA devices only"
    )


def test_a_graph_reports_the_mode_its_forward_ran():
    """A decode of one sequence is too small for TBO (``tbo_min_tokens`` 2): its graph holds
    the plain forward, and the runner says so, also when a replay runs no Python forward that
    could tell it."""
    runner, _ = _prefilled("qwen3_moe")
    runner.graphs = eager_graphs(runner, 2)
    one = ForwardBatch(torch.tensor([4]), SLOTS[:1], LENGTHS[:1], [1], is_decode=[True])
    two = ForwardBatch(torch.tensor([1, 2]), SLOTS[:2], LENGTHS[:2], [1, 1], is_decode=[True] * 2)
    for batch in (one, two):  # each bucket's "capture"
        runner.forward(batch, OverlapConfig("tbo"))
    for graph in runner.graphs.graphs.values():  # from here on, replays as a captured graph's
        graph.replay = (lambda out: lambda: out)(graph.replay())
    runner.forward(one, OverlapConfig("tbo"))
    assert runner.last_mode == "none"
    runner.forward(two, OverlapConfig("tbo"))
    assert runner.last_mode == "tbo"


def test_cuda_graph_max_bs_below_one_is_refused():
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs=0 must be an integer >= 1"):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), cuda_graph_max_bs=0)


@pytest.mark.parametrize("overlap", [OverlapConfig("none"), OverlapConfig("tbo"), DBO])
def test_the_padded_low_latency_decode_gives_the_eager_logits(overlap):
    """Emulated ep=4 (``bench --emulate-peers 4``): the low-latency dispatch, which a graph can
    hold, gives the same padded, buffer-fed decode as the eager step, every micro-batch's
    fixed-capacity all-to-alls included."""
    cfg = MODELS["qwen3_moe"]()
    runner = build_rank_runner(
        EngineSpec(cfg, seed=0, max_num_seqs=7, max_len=600, emulate_peers=4)
    )
    gen = torch.Generator().manual_seed(1)
    runner.forward(
        ForwardBatch(torch.randint(cfg.vocab_size, (343,), generator=gen), SLOTS, [0] * 3, LENGTHS)
    )
    step = ForwardBatch(torch.tensor([7, 8, 9]), SLOTS, LENGTHS, [1, 1, 1], is_decode=[True] * 3)
    low_latency = replace(overlap, a2a_mode="low_latency", tbo_min_tokens=1)
    eager = runner.forward(step, low_latency)
    assert runner.active is runner.low_latency(low_latency.num_max_dispatch_tokens_per_rank)
    graphs = eager_graphs(runner, 4, local=False)
    assert graphs.covers([step], low_latency, True)
    assert not graphs.covers([step], low_latency, False)  # the normal dispatch sizes on the host
    runner.graphs = graphs
    replayed = runner.forward(step, low_latency)
    assert runner.last_mode == overlap.mode
    assert max_abs_diff(replayed, eager) <= 1e-4
    normal = runner.forward(step, replace(low_latency, a2a_mode="normal"))  # eager: not covered
    assert max_abs_diff(normal, eager) <= 1e-4
    # the capacity bounds each micro-batch of the padded bucket (4 rows): TBO and DBO cut it
    # 2 + 2, which a capacity of 2 holds; unsplit, 4 rows pass a capacity of 3
    cap = 2 if overlap.mode != "none" else 3
    tight = replace(low_latency, num_max_dispatch_tokens_per_rank=cap)
    rows = functools.partial(runner.dispatch_rows, tight)
    assert graphs.covers([step], tight, True, rows) == (overlap.mode != "none")
    assert max_abs_diff(runner.forward(step, tight), eager) <= 1e-4
