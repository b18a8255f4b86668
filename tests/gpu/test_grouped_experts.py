"""On a GPU: the grouped GEMM (bf16, sm90+) gives the per-expert loop's rows, for plain experts
and for GPT-OSS's biased ones with the clamped SwiGLU, whole and in SBO's blocks."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.model import moe
from moe_overlap.model.expert_paths import grouped_fits
from moe_overlap.model.moe import ExpertBank
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
HIDDEN, INTER, EXPERTS = 256, 128, 8


@pytest.mark.parametrize("swiglu", [None, (1.702, 7.0)])
def test_the_grouped_gemm_gives_the_loops_rows(swiglu, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    if not grouped_fits(device, torch.bfloat16, (HIDDEN, INTER)):
        pytest.skip("this GPU runs no grouped GEMM (sm90+ with torch's grouped_mm)")
    gen = torch.Generator().manual_seed(0)
    bank = ExpertBank(HIDDEN, INTER, first=0, count=EXPERTS, swiglu=swiglu)
    for p in bank.parameters():
        p.data = torch.randn(p.shape, generator=gen) / HIDDEN**0.5
    bank = bank.to(device, torch.bfloat16)
    counts = [40, 0, 7, 1, 0, 90, 3, 15]
    x = torch.randn(sum(counts), HIDDEN, generator=gen).to(device, torch.bfloat16)
    grouped = bank(x, counts)
    blocks = torch.full_like(x, float("nan"))
    bank.run_experts(x, counts, blocks, range(0, 3))
    bank.run_experts(x, counts, blocks, range(3, EXPERTS))
    monkeypatch.setattr(moe, "grouped_fits", lambda *args: False)
    loop = bank(x, counts)
    assert torch.allclose(grouped.float(), loop.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(blocks, grouped)
