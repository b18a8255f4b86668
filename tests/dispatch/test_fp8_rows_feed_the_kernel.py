"""The FP8 dispatch's rows go into the W8A8 experts' grouped kernel as they arrived (values
and scales, as DeepEP's rows feed DeepGEMM): never decoded to the run dtype and quantized
again. The kernel runs on CPU in Triton's interpreter, forced on as on a GPU; each rank of a
real gloo group gives the one-process run's bits, over the normal and the low-latency
all-to-all."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.fp8_rows import Fp8Rows
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.dispatch.low_latency import LowLatencyDispatcher
from moe_overlap.distributed.groups import init_process_groups
from moe_overlap.distributed.layout import layout_for
from moe_overlap.model import fp8_grouped, fp8_resident, fp8_w8a8, loader
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.fp8_grouped import grouped_fp8, grouped_fp8_rows, kernel_matches
from moe_overlap.model.fp8_scale_layout import pad_grid
from moe_overlap.model.fp8_w8a8 import W8A8Experts
from moe_overlap.model.fp8_weights import quantize
from moe_overlap.model.loader import build_model, save_checkpoint
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


MODES = ["none", "tbo", "tbo+two-chunk", "sbo"]


def test_an_fp8_engine_with_fp8_dispatch_feeds_the_kernel_in_every_mode(tmp_path, monkeypatch):
    """One process, every overlap mode: the experts take the dispatch's FP8 rows into the
    kernel (counted), none decodes them, and every mode gives no overlap's logits."""
    monkeypatch.setattr(loader, "keeps_fp8", lambda device, on_the_fly: True)
    monkeypatch.setattr(fp8_resident, "w8a8_available", lambda device: True)
    monkeypatch.setattr(fp8_w8a8, "grouped_works", kernel_matches)
    monkeypatch.setattr(Fp8Rows, "decode", never_decoded)
    fed = []
    counted = fp8_grouped.grouped_fp8_rows

    def counting(*args, **kwargs):
        fed.append(args[0].shape[0])
        return counted(*args, **kwargs)

    monkeypatch.setattr(fp8_w8a8, "grouped_fp8_rows", counting)
    config = ModelConfig.from_hf("configs/qwen3-moe-tiny.json")
    cfg = dataclasses.replace(config, moe_intermediate_size=128)
    save_checkpoint(build_model(cfg), tmp_path)
    quantize_checkpoint(tmp_path, (128, 128))
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (21, 5, 13)]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    runs = {}
    for mode in MODES:
        fp8 = dict(tbo_min_tokens=1, moe_dispatch_dtype="fp8")
        with LLM(tmp_path, overlap=dataclasses.replace(mode_config(mode), **fp8)) as llm:
            fed.clear()
            runs[mode] = llm.generate(prompts, params, return_logits=True)
            assert fed and sum(fed) > 0, mode
    for mode in MODES[1:]:
        for a, b in zip(runs["none"], runs[mode], strict=True):
            assert a.token_ids == b.token_ids, mode
            assert (a.prompt_logits - b.prompt_logits).abs().max().item() <= 1e-4, mode
