"""Experts as one grouped GEMM: when it is chosen, that the fallback is today's path, and (where
this torch runs grouped_mm on the CPU) that the grouped path's offsets, transposes and SBO
block slices give the per-expert results."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.core.dispatcher import host_counts
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model import expert_paths, moe
from moe_overlap.model.expert_paths import grouped_fits
from moe_overlap.model.moe import ExpertBank
from tests.model.test_experts import BANK, EXPERTS, HIDDEN, per_expert

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


@pytest.mark.parametrize(
    ("device", "dtype", "capability", "dims", "chosen"),
    [
        (CUDA, torch.bfloat16, (9, 0), (2048, 768), True),  # H100, Qwen3-30B-A3B's shapes
        (CUDA, torch.bfloat16, (10, 0), (7168, 2048), True),  # Blackwell
        (CUDA, torch.bfloat16, (8, 0), (2048, 768), False),  # A100: the padded bmm / loop
        (CUDA, torch.float32, (9, 0), (2048, 768), False),  # fp32 stays the reference
        (CUDA, torch.bfloat16, (9, 0), (2048, 100), False),  # rows not 16-byte aligned
        (torch.device("cpu"), torch.bfloat16, (9, 0), (2048, 768), False),
        (torch.device("cpu"), torch.float32, (9, 0), (2048, 768), False),
    ],
)
def test_grouped_gemm_is_chosen_for_bf16_on_sm90_and_aligned_rows_only(
    device, dtype, capability, dims, chosen, monkeypatch
):
    monkeypatch.setattr(expert_paths, "_capability", lambda device: capability)
    assert grouped_fits(device, dtype, dims) is chosen


def test_no_grouped_gemm_in_this_torch_means_the_fallback(monkeypatch):
    monkeypatch.setattr(expert_paths, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(expert_paths, "GROUPED_MM", None)
    assert not grouped_fits(CUDA, torch.bfloat16, (2048, 768))


def test_fp32_on_cpu_never_calls_the_grouped_gemm(monkeypatch):
    """The fallback is today's code itself: the forward is bit-identical to the padded bmm /
    per-expert path because it is that path (the grouped GEMM would raise here)."""

    def refuse(*args, **kwargs):
        raise AssertionError("grouped GEMM called for fp32 on CPU")

    monkeypatch.setattr(moe, "GROUPED_MM", refuse)
    for counts in ([3, 0, 5, 1, 2, 4], [300, 2, 0, 0, 7, 1]):
        x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(2))
        assert torch.allclose(BANK(x, counts), per_expert(x, counts), atol=1e-5, rtol=1e-5)


def _cpu_grouped_mm_runs() -> bool:
    if moe.GROUPED_MM is None:
        return False
    try:
        moe.GROUPED_MM(
            torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32)
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_grouped_mm_runs(), reason="this torch has no CPU grouped_mm")
@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 2, 4], [0, 0, 9, 0, 0, 1], [40, 1, 0, 0, 7, 33]])
def test_the_grouped_path_matches_per_expert_and_its_blocks_are_exact(counts, monkeypatch):
    monkeypatch.setattr(moe, "grouped_fits", lambda *args: True)
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(3))
    whole = BANK(x, counts)
    assert torch.allclose(whole, per_expert(x, counts), atol=1e-5, rtol=1e-5)
    for cut in range(1, EXPERTS):  # SBO: blocks as slices of the same offsets
        blocks = torch.full_like(x, float("nan"))
        BANK.run_experts(x, counts, blocks, range(0, cut))
        BANK.run_experts(x, counts, blocks, range(cut, EXPERTS))
        assert torch.equal(whole, blocks)


@pytest.mark.skipif(not _cpu_grouped_mm_runs(), reason="this torch has no CPU grouped_mm")
def test_the_local_dispatch_feeds_the_grouped_gemm_its_device_counts_unread(monkeypatch):
    """The local backend leaves its counts on the device; where the experts run grouped they
    take them there (nothing read: what lets a CUDA graph hold a decode step), and give the
    rows the host-counts path gives."""
    monkeypatch.setattr(moe, "grouped_fits", lambda *args: True)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(7, HIDDEN, generator=gen)
    ids = torch.randint(EXPERTS, (7, 2), generator=gen)
    weights = torch.rand(7, 2, generator=gen)
    state = LocalDispatcher(EXPERTS).dispatch_a(hidden, ids, weights)
    assert state.tokens_per_expert is None and state.counts is not None
    on_device = BANK.run_dispatched(state)
    assert state.tokens_per_expert is None  # the device's counts were enough
    assert torch.equal(on_device, BANK(state.expert_inputs, host_counts(state)))
    assert host_counts(state) == torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()


@pytest.mark.skipif(not _cpu_grouped_mm_runs(), reason="this torch has no CPU grouped_mm")
def test_biased_experts_take_each_rows_bias_from_the_device_offsets(monkeypatch):
    """GPT-OSS's experts (biases, clamped SwiGLU): the grouped path finds each row's expert
    from ``offs`` on the device, and matches the per-expert loop, whole and in SBO blocks."""
    gen = torch.Generator().manual_seed(4)
    biased = ExpertBank(HIDDEN, 32, first=0, count=EXPERTS, swiglu=(1.702, 7.0))
    for p in biased.parameters():
        p.data = torch.randn(p.shape, generator=gen) / HIDDEN**0.5
    counts = [3, 0, 5, 1, 0, 4]
    x = torch.randn(sum(counts), HIDDEN, generator=gen)
    loop = biased(x, counts)  # grouped_fits is False on CPU: the per-expert path
    monkeypatch.setattr(moe, "grouped_fits", lambda *args: True)
    assert torch.allclose(biased(x, counts), loop, atol=1e-5, rtol=1e-5)
    blocks = torch.full_like(x, float("nan"))
    biased.run_experts(x, counts, blocks, range(0, 3))
    biased.run_experts(x, counts, blocks, range(3, EXPERTS))
    assert torch.allclose(blocks, loop, atol=1e-5, rtol=1e-5)
