"""On a GPU: the low-latency dispatch's experts as one grouped GEMM over the real rows (bf16,
sm90+) give the padded batched matmul's rows, and an emulated ep=4 decode over it (TBO, SBO,
DBO) replays from a CUDA graph, communication stream and modelled link wait included, bit for
bit as the same buffer-fed forward run eagerly."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.distributed.link import parse_link
from moe_overlap.model import moe
from moe_overlap.model.expert_paths import grouped_fits
from moe_overlap.model.moe import ExpertBank
from moe_overlap.runtime.rank import build_rank_runner
from tests.gpu.common import needs_gpu
from tests.helpers import TINY
from tests.runtime.test_cuda_graphs import eager_graphs

pytestmark = needs_gpu
HIDDEN, INTER, EP, LOCAL, CAP = 256, 128, 4, 3, 16


def test_grouped_capacity_experts_match_the_padded_path(monkeypatch):
    device = torch.device("cuda")
    if not grouped_fits(device, torch.bfloat16, (HIDDEN, INTER)):
        pytest.skip("no grouped GEMM here (bf16 on sm90+)")
    gen = torch.Generator().manual_seed(0)
    bank = ExpertBank(HIDDEN, INTER, 0, LOCAL)
    for p in bank.parameters():
        p.data = (torch.randn(p.shape, generator=gen) / 16).to(device, torch.bfloat16)
    counts = torch.randint(0, CAP + 1, (EP, LOCAL), generator=gen).to(device)
    # each source's block: a header row, then CAP rows per local expert
    x = torch.randn(EP, 1 + LOCAL * CAP, HIDDEN, generator=gen).to(device, torch.bfloat16)

    def places(blocks: torch.Tensor) -> torch.Tensor:
        return blocks[:, 1:].view(EP, LOCAL, CAP, HIDDEN)

    real = torch.arange(CAP, device=device) < counts[..., None]  # only real rows are read
    grouped = torch.zeros_like(x)
    bank.run_capacity(x, counts, grouped, range(LOCAL))
    monkeypatch.setattr(moe, "grouped_fits", lambda *args: False)
    padded = torch.zeros_like(x)
    bank.run_capacity(x, counts, padded, range(LOCAL))
    diff = (places(grouped) - places(padded)).float().abs()[real]
    assert diff.max().item() <= 0.05 * places(padded).float().abs()[real].max().item()
    monkeypatch.undo()
    blocks = torch.zeros_like(x)  # SBO's blocks: the same rows as one call
    for experts in (range(0, 1), range(1, LOCAL)):
        bank.run_capacity(x, counts, blocks, experts)
    assert torch.equal(places(blocks)[real], places(grouped)[real])


@pytest.mark.parametrize("mode", ["none", "tbo", "sbo", "dbo"])
def test_an_emulated_low_latency_decode_replays_bit_for_bit(mode):
    cfg = ModelConfig(**(TINY["deepseek_v3"] | {"hidden_size": 64, "moe_intermediate_size": 32}))
    spec = EngineSpec(
        cfg,
        seed=0,
        max_num_seqs=6,
        max_len=300,
        device="cuda",
        dtype="bfloat16",
        cuda_graph_max_bs=4,
        emulate_peers=EP,
    )
    runner = build_rank_runner(spec, link_spec=parse_link("model:10gbit,50us"))
    assert runner.graphs is not None and not runner.graphs.local
    gen = torch.Generator().manual_seed(0)
    runner.forward(
        ForwardBatch(torch.randint(cfg.vocab_size, (25,), generator=gen), [0, 3], [0, 0], [5, 20])
    )
    step = ForwardBatch(
        torch.tensor([1, 2, 3]), [0, 3, 5], [5, 20, 0], [1, 1, 1], is_decode=[True] * 3
    )
    overlap = OverlapConfig(mode, tbo_min_tokens=1, dbo_decode_token_threshold=1)
    overlap = replace(overlap, a2a_mode="low_latency", num_max_dispatch_tokens_per_rank=8)
    eager = eager_graphs(runner, 4, local=False)
    runner.choose_dispatch(overlap, [step])
    expected = eager.forward(step, overlap, [step]).final_logits()
    replayed = runner.forward(step, overlap)
    assert runner.graphs.graphs, "the step did not run from a graph"
    assert runner.last_mode == mode
    assert torch.equal(replayed, expected)
    assert torch.equal(runner.forward(step, overlap), replayed)
