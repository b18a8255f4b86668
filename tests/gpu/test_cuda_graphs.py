"""On a GPU: decode replayed from CUDA graphs gives the buffer-fed forward's logits bit for bit
and the eager engine's greedy tokens, in bf16 (the grouped GEMM's dtype), without overlap and
with TBO or DBO (whose two threads launch on two streams the capture takes in)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.runtime.cuda_graphs import DecodeGraphs
from moe_overlap.runtime.rank import build_rank_runner
from tests.gpu.common import needs_gpu
from tests.helpers import TINY
from tests.runtime.test_cuda_graphs import MODELS, eager_graphs

pytestmark = needs_gpu
MODES = {
    "none": OverlapConfig("none"),
    "tbo": OverlapConfig("tbo", tbo_min_tokens=1),
    "dbo": OverlapConfig("dbo", dbo_decode_token_threshold=1),
}


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_replayed_decode_equals_the_same_forward_run_eagerly(family, mode):
    cfg = MODELS[family]()
    spec = EngineSpec(
        cfg,
        seed=0,
        max_num_seqs=6,
        max_len=300,
        device="cuda",
        dtype="bfloat16",
        cuda_graph_max_bs=4,
    )
    runner = build_rank_runner(spec)
    assert runner.graphs is not None, DecodeGraphs.supported(
        runner.model, torch.device("cuda"), runner.dispatcher, runner.low_latency_fits
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(cfg.vocab_size, (205,), generator=gen)
    runner.forward(ForwardBatch(prompts, [0, 3], [0, 0], [5, 200]))  # 200: past a 128 window
    step = ForwardBatch(
        torch.tensor([1, 2, 3]), [0, 3, 5], [5, 200, 0], [1, 1, 1], is_decode=[True] * 3
    )  # slot 5's first token: a sequence of one
    overlap = MODES[mode]
    eager = eager_graphs(runner, 4)
    expected = eager.forward(step, overlap).final_logits()
    replayed = runner.forward(step, overlap)
    assert runner.graphs.graphs, "the step did not run from a graph"
    assert torch.equal(replayed, expected)
    again = runner.forward(step, overlap)  # a second replay: the same buffers, the same logits
    assert torch.equal(again, replayed)


@pytest.mark.parametrize(
    "overlap",
    [
        {},
        {"enable_two_batch_overlap": True, "tbo_min_tokens": 1},
    ],  # DBO needs two ranks in an engine: its graphs are checked on the runner above
)
def test_graph_decode_gives_the_eager_engines_tokens(overlap):
    cfg = ModelConfig(**TINY["qwen3_moe"])
    prompts = [[1 + i, 5, 9, 2 * i + 3][: 1 + i % 4] for i in range(7)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    tokens = {}
    for graphs in (True, False):
        kw = dict(config=cfg, device="cuda", dtype="bfloat16", seed=0, max_num_seqs=8)
        with LLM(**kw, disable_cuda_graph=not graphs, **overlap) as llm:
            tokens[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
            used = llm.executor.runner.graphs
            assert (used is not None and bool(used.graphs)) == graphs
    assert tokens[True] == tokens[False]
