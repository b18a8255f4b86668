"""On a GPU: speculative decoding's verify steps (k + 1 rows per sequence) and the MTP drafter's
steps replayed from CUDA graphs, in bf16 (the grouped GEMM's dtype), one process. A
replayed verify equals the same buffer-fed forward run eagerly bit for bit, without overlap, with
TBO (cut by whole sequences) and with DBO; and an engine's graphed speculative decode gives the
tokens of its eager speculative decode and of plain greedy decoding, with n-gram drafts (tiny
Qwen3-MoE) and with DeepSeek-V3's MTP drafts (tiny, one MTP layer, two steps)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.runtime.cuda_graphs import DecodeGraphs
from moe_overlap.runtime.graph_buckets import Bucket
from moe_overlap.runtime.rank import build_rank_runner
from tests.gpu.common import needs_gpu
from tests.gpu.test_cuda_graphs import MODES
from tests.helpers import TINY
from tests.runtime.test_cuda_graphs import eager_graphs
from tests.runtime.test_spec_graphs import MTP_DEEPSEEK, PROMPTS, graphed_and_eager, verify

pytestmark = needs_gpu
GPU = dict(device="cuda", dtype="bfloat16", seed=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_replayed_verify_equals_the_same_forward_run_eagerly(family, mode):
    cfg = ModelConfig(**TINY[family])
    spec = EngineSpec(cfg, max_num_seqs=6, max_len=300, cuda_graph_max_bs=4, **GPU)
    runner = build_rank_runner(spec)
    assert runner.graphs is not None, DecodeGraphs.supported(
        runner.model, torch.device("cuda"), runner.dispatcher, runner.low_latency_fits
    )
    gen = torch.Generator().manual_seed(0)
    runner.forward(ForwardBatch(torch.randint(cfg.vocab_size, (85,), generator=gen),
                                [0, 3, 5], [0, 0, 0], [5, 60, 20]))  # fmt: skip
    step = verify([0, 3, 5], [5, 60, 20], 4, torch.randint(cfg.vocab_size, (12,), generator=gen))
    overlap = MODES[mode]
    expected = eager_graphs(runner, 4).forward(step, overlap).final_logits()
    replayed = runner.forward(step, overlap)
    assert {key[0] for key in runner.graphs.graphs} == {Bucket(4, 4, 256)}
    assert runner.graphs.failed == 0
    assert torch.equal(replayed, expected)
    assert torch.equal(runner.forward(step, overlap), replayed)  # a second replay


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_graphed_speculative_decode_gives_eager_and_plain_greedy_tokens(drafter):
    cfg, spec = {
        "ngram": (ModelConfig(**TINY["qwen3_moe"]), dict(speculative_algorithm="NGRAM")),
        "mtp": (MTP_DEEPSEEK, dict(speculative_algorithm="EAGLE", speculative_num_steps=2)),
    }[drafter]
    kw = dict(max_num_seqs=len(PROMPTS), cuda_graph_max_bs=8, enable_prefix_caching=False)
    with LLM(config=cfg, **GPU, **kw, **spec) as llm:
        runner = llm.executor.runner
        assert runner.graphs is not None, "no decode graphs on this GPU"
        assert (runner.mtp is not None and runner.mtp.graphs is not None) == (drafter == "mtp")
        got = graphed_and_eager(llm)
        failed = runner.graphs.failed + (runner.mtp.graphs.failed if runner.mtp else 0)
    eager_drafts, graphed_drafts = got["drafts"]
    same = sum(a == b for a, b in zip(eager_drafts, graphed_drafts, strict=False))
    print(f"{drafter}: verify steps {got['verifies']}, buckets {sorted(got['buckets'], key=str)}, "
          f"MTP steps with the eager run's drafts {same}/{len(eager_drafts)}")  # fmt: skip
    assert failed == 0
    assert got["eager"] == got["plain"]
    assert got["graphed"] == got["plain"]
    assert all(n > 0 for n in got["verifies"]), got["verifies"]
    assert max(b.width for b in got["buckets"]) > 1  # verify steps replayed
    if drafter == "mtp":
        assert got["draft_buckets"]  # the second MTP step replayed
