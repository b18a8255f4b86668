"""On a GPU: a decode forward makes no host sync but the one read per dispatch, under
``torch.cuda.set_sync_debug_mode("error")`` (the GPU side of tests/runtime/test_host_syncs.py)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core import dispatcher, transfer
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.dispatch import gather
from moe_overlap.runtime.rank import build_rank_runner
from tests.gpu.common import needs_gpu
from tests.helpers import TINY

pytestmark = needs_gpu
DECODE = ForwardBatch(
    torch.tensor([5, 6, 7]), [0, 1, 3], [4, 9, 2], [1, 1, 1], is_decode=[True] * 3
)


@pytest.mark.parametrize("family", sorted(TINY))
def test_a_decode_step_syncs_only_to_read_each_dispatchs_counts(family, monkeypatch):
    cfg = ModelConfig(**TINY[family])
    runner = build_rank_runner(EngineSpec(cfg, seed=0, max_num_seqs=4, max_len=64, device="cuda"))
    runner.forward(DECODE)  # warm-up: the cache and RoPE tables grow, kernels load
    torch.cuda.synchronize()
    reads: list[int] = []

    def allowed_read(counts: torch.Tensor, total: int) -> torch.Tensor:
        reads.append(total)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return transfer.read_counts(counts, total)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    for module in (dispatcher, gather):  # one process: the local dispatch
        monkeypatch.setattr(module, "read_counts", allowed_read)
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.forward(DECODE)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(logits).all()
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert len(reads) == moe_layers
