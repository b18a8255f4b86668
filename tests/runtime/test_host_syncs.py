"""The forward reads the device once per dispatch and nowhere else: the CI gate for host syncs.

A decode and a mixed forward (no overlap, SBO, TBO; the local, all-to-all and tensor-parallel
dispatchers on one rank) run with weights, KV cache and activations on ``meta`` tensors, which
have shapes but no data. Anything that would make the host wait for a GPU raises there:
``.item()``/``int(t)``/``.tolist()``/``.cpu()`` of a device tensor, ``nonzero``, boolean-mask
indexing, ``bincount``, ``repeat_interleave`` without ``output_size``. Host metadata (the
batch's lists, index tensors built from them) stays on the CPU and is sent with
``core/transfer.py: to_device``. The one read allowed, the split sizes of each dispatch
(``read_counts``), is wrapped to count its calls: one per MoE layer.
On a GPU the same contract is ``torch.cuda.set_sync_debug_mode("error")`` around a step.
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core import dispatcher, transfer
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch import gather
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.gather import GatherDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.tools.device_ops import meta_runner
from tests.helpers import TINY

DECODE = ForwardBatch(
    torch.tensor([5, 6, 7]), [0, 1, 3], [4, 9, 2], [1, 1, 1], is_decode=[True] * 3
)
MIXED = ForwardBatch(
    torch.arange(6), [0, 2], [4, 0], [1, 5], all_logits=[False, True], is_decode=[True, False]
)


_READ_COUNTS = transfer.read_counts


def _counted(calls: list[int]):
    def read_counts(counts: torch.Tensor, total: int) -> torch.Tensor:
        assert counts.device.type == "meta", "read_counts is for device tensors"
        calls.append(total)
        return _READ_COUNTS(counts, total)  # on meta: the rows spread evenly

    return read_counts


def _meta_runner(family: str, backend: str, dtype: str = "float32"):
    cfg = ModelConfig(**TINY[family])
    runner = meta_runner(cfg, dtype, max_len=64, seqs=4)
    if backend == "torch":  # the all-to-all path on a one-rank group
        runner.dispatcher = AllToAllDispatcher(Group.single(name="ep"), cfg.num_experts)
    elif backend == "none":  # the tensor-parallel MoE's path, one rank
        tp, dp = Group.single(name="tp"), Group.single(name="attn_dp")
        runner.dispatcher = GatherDispatcher(tp, dp, 0, 0, 1, cfg.num_experts)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return runner, moe_layers


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("backend", ["local", "torch", "none"])
@pytest.mark.parametrize("mode", ["none", "sbo", "tbo"])
def test_forward_reads_the_device_once_per_dispatch(family, backend, mode, monkeypatch):
    calls: list[int] = []
    for module in (dispatcher, transfer, gather):  # the all-to-all reads through transfer's
        monkeypatch.setattr(module, "read_counts", _counted(calls))
    runner, moe_layers = _meta_runner(family, backend)
    overlap = None if mode == "none" else OverlapConfig(mode, tbo_min_tokens=1)
    for batch in (DECODE, MIXED):
        calls.clear()
        logits = runner.forward(batch, overlap)
        assert logits.device.type == "meta"
        assert logits.shape[0] == len(batch.logit_rows())
        # one read per dispatch: per MoE layer, one per micro-batch (two under TBO), which
        # together read every (token, slot) pair once
        micro_batches = 2 if mode == "tbo" else 1
        assert len(calls) == moe_layers * micro_batches
        assert sum(calls) == batch.num_tokens * runner.model.cfg.num_experts_per_tok * moe_layers


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("mode", ["none", "tbo"])
def test_one_process_grouped_experts_read_nothing(family, mode, monkeypatch):
    """bf16 experts that run as one grouped GEMM (sm90+; ``meta`` stands in for it) take the
    local dispatch's counts on the device: a one-process decode reads the device not once
    (what lets a CUDA graph hold the step)."""
    calls: list[int] = []
    monkeypatch.setattr(dispatcher, "read_counts", _counted(calls))
    runner, _ = _meta_runner(family, "local", "bfloat16")
    overlap = None if mode == "none" else OverlapConfig(mode, tbo_min_tokens=1)
    for batch in (DECODE, MIXED):
        assert runner.forward(batch, overlap).shape[0] == len(batch.logit_rows())
    assert calls == []


@pytest.mark.parametrize(
    "sync",
    [
        lambda t: t.sum().item(),
        lambda t: int(t.max()),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: t.nonzero(),
        lambda t: t[t > 0],
        lambda t: torch.bincount(t),
        lambda t: t.repeat_interleave(t),
    ],
)
def test_the_gate_catches_each_kind_of_sync(sync):
    """Each kind of host sync the forward must not make fails on meta tensors, so the gate
    above would fail if one came back."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        sync(torch.ones(4, dtype=torch.long, device="meta"))
