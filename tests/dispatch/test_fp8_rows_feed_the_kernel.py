"""The FP8 dispatch's rows go into the W8A8 experts' grouped kernel as they arrived (values
and scales, as DeepEP's rows feed DeepGEMM): never decoded to the run dtype and quantized
again. The kernel runs on CPU in Triton's interpreter, forced on as on a GPU; each rank of a
real gloo group gives the one-process run's bits, over the normal and the low-latency
all-to-all."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.fp8_rows import Fp8Rows
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.dispatch.low_latency import LowLatencyDispatcher
from moe_overlap.distributed.groups import init_process_groups
from moe_overlap.distributed.layout import layout_for
from moe_overlap.model import fp8_w8a8
from moe_overlap.model.fp8_grouped import grouped_fp8, grouped_fp8_rows, kernel_matches
from moe_overlap.model.fp8_scale_layout import pad_grid
from moe_overlap.model.fp8_w8a8 import W8A8Experts
from moe_overlap.model.fp8_weights import dequantize, quantize
from moe_overlap.model.moe import ExpertBank
from tests.dist_utils import init_gloo, run_workers

EXPERTS, HIDDEN, INTER, TOP_K = 4, 256, 128, 2
WIRE = Fp8Rows(HIDDEN, torch.float32)


def fp8_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    pairs = [
        quantize(torch.randn(n, k, generator=gen) / k**0.5, (128, 128)) for _ in range(EXPERTS)
    ]
    return torch.stack([q for q, _ in pairs]), torch.stack([g for _, g in pairs])


def bank_of(experts: range) -> ExpertBank:
    """The W8A8 bank of ``experts`` (of one seeded set), on the interpreted kernel (the caller
    makes ``fp8_w8a8.grouped_works`` say so)."""
    bank = ExpertBank(HIDDEN, INTER, first=experts.start, count=len(experts))
    block = slice(experts.start, experts.stop)
    gate_up, down = fp8_weights(2 * INTER, HIDDEN, 1), fp8_weights(HIDDEN, INTER, 2)
    bank.w8a8 = W8A8Experts(
        (gate_up[0][block], gate_up[1][block]), (down[0][block], down[1][block])
    )
    assert bank.w8a8.grouped, "the interpreted kernel failed its check"
    return bank


def routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    tokens = 5 + 4 * rank
    hidden = torch.randn(tokens, HIDDEN, generator=gen) * torch.logspace(-2, 2, tokens)[:, None]
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])
    return hidden, ids, torch.rand(tokens, TOP_K, generator=gen)


def moe_layer(dispatcher, bank: ExpertBank, rank: int) -> torch.Tensor:
    state = dispatcher.dispatch_a(*routing(rank))
    dispatcher.dispatch_b(state)
    state.expert_outputs = bank.run_dispatched(state)
    dispatcher.combine_a(state)
    return dispatcher.combine_b(state)


def never_decoded(self, rows):
    raise AssertionError("the FP8 rows were decoded before the experts")


def rank_worker(rank: int, world: int, port: int, low_latency: bool) -> torch.Tensor:
    init_gloo(rank, world, port)
    Fp8Rows.decode = never_decoded  # this rank process's own modules only
    fp8_w8a8.grouped_works = kernel_matches  # the interpreted kernel, as on a GPU
    group = init_process_groups(layout_for(ParallelConfig(ep=world)), rank, "gloo")["ep"]
    dispatcher = AllToAllDispatcher(group, EXPERTS, wire=WIRE)
    if low_latency:
        dispatcher = LowLatencyDispatcher(dispatcher, capacity=16)
    local = EXPERTS // world
    return moe_layer(dispatcher, bank_of(range(rank * local, (rank + 1) * local)), rank)


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low-latency"])
def test_each_rank_gives_the_one_process_bits_without_decoding(low_latency, monkeypatch):
    monkeypatch.setattr(Fp8Rows, "decode", never_decoded)
    monkeypatch.setattr(fp8_w8a8, "grouped_works", kernel_matches)
    bank = bank_of(range(EXPERTS))
    one_process = [moe_layer(LocalDispatcher(EXPERTS, WIRE), bank, rank) for rank in range(2)]
    ranks = run_workers(rank_worker, 2, low_latency, timeout=120)
    for got, expected in zip(ranks, one_process, strict=True):
        assert torch.equal(got, expected)


def test_the_arrived_rows_give_the_product_of_what_they_decode_to():
    """The wire's values and scales, read in place (rows ``width`` bytes apart), give the
    grouped product of their decoded rows: in float32 a second quantization of those rows
    reproduces the same values and scales, so the bits match."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(70, HIDDEN, generator=gen) * torch.logspace(-3, 3, 70)[:, None]
    x[4] = 0  # an all-zero row: scale 0
    wire = WIRE.encode(x)
    q, grid = fp8_weights(256, HIDDEN, 4)
    ends = torch.tensor([3, 3, 50, 70], dtype=torch.int32)
    fed = grouped_fp8_rows(*WIRE.parts(wire), torch.float32, ends, q, pad_grid(grid))
    assert torch.equal(fed, grouped_fp8(WIRE.decode(wire), ends, q, pad_grid(grid)))


def test_a_kernel_that_gives_up_falls_back_to_the_decoded_rows(monkeypatch):
    """Where the kernel raises on the arrived rows (a GPU without it), the bank decodes them
    and runs its dequantized weights, from then on: the same product up to FP8's rounding of
    the second projection's input, in the local and the low-latency layouts."""
    monkeypatch.setattr(fp8_w8a8, "grouped_works", kernel_matches)
    expected = moe_layer(LocalDispatcher(EXPERTS, WIRE), bank_of(range(EXPERTS)), 0)

    def gives_up(*args):
        raise RuntimeError("no such kernel here")

    monkeypatch.setattr(fp8_w8a8, "grouped_fp8_rows", gives_up)
    bank = bank_of(range(EXPERTS))
    for weights, (q, grid) in (
        (bank.gate_up_proj, bank.w8a8.gate_up),
        (bank.down_proj, bank.w8a8.down),
    ):
        k = q.shape[2] // 128
        weights.data = torch.stack(
            [dequantize(q[e], grid[e, :, :k], (128, 128)) for e in range(EXPERTS)]
        )
    got = moe_layer(LocalDispatcher(EXPERTS, WIRE), bank, 0)
    assert not bank.w8a8.grouped and bank.w8a8.failed  # both W8A8 paths gave up on CPU
    torch.testing.assert_close(got, expected, rtol=0.1, atol=0.05 * expected.abs().max().item())
    # the low-latency blocks: decoded, then the padded batched matmul
    ep, cap = 2, 5
    counts = torch.tensor([[2, 0, 5, 1], [0, 3, 1, 0]])
    blocks = WIRE.encode(torch.randn(ep * (1 + EXPERTS * cap), HIDDEN)).view(ep, -1, WIRE.width)
    out = torch.full((ep, 1 + EXPERTS * cap, HIDDEN), float("nan"))
    bank.run_capacity(blocks, counts, out, range(EXPERTS), WIRE, top_k=2)
    # the same rows, decoded and grouped by expert on the host (each block's first is a header)
    sent = blocks[:, 1:].view(ep, EXPERTS, cap, -1)
    rows = [sent[p, e, : counts[p, e]] for e in range(EXPERTS) for p in range(ep)]
    flat = bank(WIRE.decode(torch.cat(rows)), counts.sum(0).tolist())
    outputs = out[:, 1:].view(ep, EXPERTS, cap, HIDDEN)
    real = [outputs[p, e, : counts[p, e]] for e in range(EXPERTS) for p in range(ep)]
    torch.testing.assert_close(torch.cat(real), flat, rtol=1e-5, atol=1e-6)
