"""The grouped FP8 expert kernel (``model/fp8_grouped_kernel.py``), run on CPU in Triton's
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``): its product, the tile map
that feeds it, an expert bank that runs it on the device's counts (the local dispatch's, the
low-latency blocks') with the bits of the host-counts path, whole and in SBO blocks, and a
whole engine on it in every overlap mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.dispatch.fp8_rows import Fp8Rows
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model import fp8_resident, fp8_w8a8, loader
from moe_overlap.model.fp8_checkpoint import quantize_checkpoint
from moe_overlap.model.fp8_grouped import (
    BLOCK_M,
    grouped_fp8,
    grouped_works,
    kernel_matches,
    reference,
    tile_map,
)
from moe_overlap.model.fp8_scale_layout import pad_grid
from moe_overlap.model.fp8_w8a8 import W8A8Experts
from moe_overlap.model.fp8_weights import quantize
from moe_overlap.model.loader import build_model, save_checkpoint
from moe_overlap.model.moe import ExpertBank
from tests.dispatch.test_fp8_rows_feed_the_kernel import never_decoded

EXPERTS, HIDDEN, INTER = 4, 128, 128
TINY_CONFIG = "configs/qwen3-moe-tiny.json"  # hidden 128: its layers fit 128x128 blocks


def fp8_experts(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``EXPERTS`` random ``[n, k]`` weights in FP8 with 128x128 grids (``[E, n/128, k/128]``)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [
        quantize(torch.randn(n, k, generator=gen) / k**0.5, (128, 128)) for _ in range(EXPERTS)
    ]
    return torch.stack([q for q, _ in pairs]), torch.stack([g for _, g in pairs])


def ends_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize("counts", [[3, 0, 70, 1], [0, 0, 0, 129], [64, 64, 1, 0], [0, 0, 0, 0]])
def test_the_kernel_computes_the_dequantized_product_of_the_quantized_rows(counts):
    q, grid = fp8_experts(256, 384, seed=0)  # K = 384: three scale groups, the grid padded to 4
    x = torch.randn(sum(counts), 384, generator=torch.Generator().manual_seed(1))
    y = grouped_fp8(x, ends_of(counts), q, pad_grid(grid))
    expected = reference(x, ends_of(counts).tolist(), q, grid)
    assert y.shape == (sum(counts), 256)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    # a row's bits do not depend on the rows beside it (micro-batches, SBO blocks)
    last = counts[-1]
    if last:
        alone = grouped_fp8(x[-last:], ends_of([0, 0, 0, last]), q, pad_grid(grid))
        assert torch.equal(alone, y[-last:])


def test_the_check_passes_here_and_a_wrong_layout_is_refused():
    assert kernel_matches(torch.device("cpu"))  # interpreted
    assert not grouped_works(torch.device("cpu"))  # the engine's CPU path dequantizes
    q, grid = fp8_experts(128, 128, seed=2)
    with pytest.raises(ValueError, match="row-major"):
        grouped_fp8(torch.randn(2, 128), ends_of([2, 2, 2, 2]), q.transpose(1, 2), grid)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3 * BLOCK_M), min_size=1, max_size=9))
def test_the_tile_map_covers_every_row_once(counts):
    ends = ends_of(counts)
    expert, first = tile_map(ends, sum(counts))
    covered = []
    for e, row in zip(expert.tolist(), first.tolist(), strict=True):
        if e < len(counts):
            covered += range(row, min(row + BLOCK_M, ends[e].item()))
            assert ends[e].item() - counts[e] <= row < ends[e].item()
    assert sorted(covered) == list(range(sum(counts)))


@pytest.fixture
def fp8_bank(monkeypatch) -> ExpertBank:
    """A W8A8 bank whose experts run the kernel on CPU (interpreted), as on a GPU."""
    monkeypatch.setattr(fp8_w8a8, "grouped_works", kernel_matches)
    bank = ExpertBank(HIDDEN, INTER, first=0, count=EXPERTS)
    bank.w8a8 = W8A8Experts(fp8_experts(2 * INTER, HIDDEN, 3), fp8_experts(HIDDEN, INTER, 4))
    assert bank.w8a8.grouped, "the interpreted kernel failed its check"
    return bank


def test_a_w8a8_bank_runs_the_kernel_on_host_and_device_counts_alike(fp8_bank):
    bank = fp8_bank
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    ids = torch.randint(EXPERTS, (9, 2), generator=gen)
    state = LocalDispatcher(EXPERTS).dispatch_a(hidden, ids, torch.rand(9, 2, generator=gen))
    on_device = bank.run_dispatched(state)
    assert state.tokens_per_expert is None  # the device's counts were enough: nothing read
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS).tolist()
    x = state.expert_inputs
    assert torch.equal(on_device, bank(x, counts))
    gate, up = reference(x, ends_of(counts).tolist(), *bank.w8a8.gate_up).chunk(2, dim=-1)
    expected = reference(
        torch.nn.functional.silu(gate) * up, ends_of(counts).tolist(), *bank.w8a8.down
    )
    torch.testing.assert_close(on_device, expected, rtol=1e-4, atol=1e-4)
    for cut in range(1, EXPERTS):  # SBO's blocks: the same bits
        blocks = torch.full_like(x, float("nan"))
        bank.run_experts(x, counts, blocks, range(0, cut))
        bank.run_experts(x, counts, blocks, range(cut, EXPERTS))
        assert torch.equal(blocks, on_device)


def test_the_low_latency_blocks_run_the_kernel_over_their_real_rows_only(fp8_bank):
    bank, ep, cap = fp8_bank, 2, 5
    counts = torch.tensor([[2, 0, 5, 1], [0, 3, 1, 0]])
    gen = torch.Generator().manual_seed(6)
    blocks = torch.randn(ep, 1 + EXPERTS * cap, HIDDEN, generator=gen)  # a header row, then

    def places(full: torch.Tensor) -> torch.Tensor:  # each expert's capacity rows
        return full[:, 1:].view(ep, EXPERTS, cap, HIDDEN)

    x = places(blocks)
    out = torch.full_like(blocks, float("nan"))
    bank.run_capacity(blocks, counts, out, range(EXPERTS))
    # the same rows, grouped by expert on the host
    rows = [x[p, e, : counts[p, e]] for e in range(EXPERTS) for p in range(ep)]
    flat = bank(torch.cat(rows), counts.sum(0).tolist())
    assert torch.equal(
        torch.cat([places(out)[p, e, : counts[p, e]] for e in range(EXPERTS) for p in range(ep)]),
        flat,
    )
    real = torch.arange(cap)[None, None] < counts[..., None]
    assert out[:, 0].isnan().all()  # each block's header row is left alone
    halves = torch.full_like(blocks, float("nan"))
    bank.run_capacity(blocks, counts, halves, range(0, 2))
    bank.run_capacity(blocks, counts, halves, range(2, EXPERTS))
    assert torch.equal(places(halves)[real], places(out)[real])
    # each token picks 2 experts: at most ep x cap x 2 real rows, so only those are gathered
    gathered, run = [], bank._on_device
    bank._on_device = lambda rows, *a: gathered.append(rows.shape[0]) or run(rows, *a)
    bounded = torch.full_like(blocks, float("nan"))
    bank.run_capacity(blocks, counts, bounded, range(EXPERTS), top_k=2)
    assert gathered == [ep * cap * 2] and torch.equal(places(bounded)[real], places(out)[real])


MODES = ["none", "tbo", "tbo+two-chunk", "sbo"]


@pytest.mark.parametrize("dispatch", ["auto", "fp8"])
def test_an_fp8_engine_on_the_kernel_gives_every_modes_logits(dispatch, tmp_path, monkeypatch):
    """The whole engine, its FP8 experts forced onto the kernel as on a GPU (interpreted here;
    the linears fall back to their dequantized weights, as CPU has no block-scaled GEMM): TBO,
    its two-chunk cut and SBO's blocks give no overlap's logits and tokens, as the kernel's rows
    never depend on the rows beside them. Under ``--moe-dispatch-dtype fp8`` the dispatch's
    rows go into the kernel as they arrived (counted), never decoded."""
    monkeypatch.setattr(loader, "keeps_fp8", lambda device, on_the_fly: True)
    monkeypatch.setattr(fp8_resident, "w8a8_available", lambda device: True)
    monkeypatch.setattr(fp8_w8a8, "grouped_works", kernel_matches)
    fed = []
    if dispatch == "fp8":
        monkeypatch.setattr(Fp8Rows, "decode", never_decoded)
        feed = fp8_w8a8.grouped_fp8_rows
        monkeypatch.setattr(fp8_w8a8, "grouped_fp8_rows", lambda *a: fed.append(1) or feed(*a))
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY_CONFIG), moe_intermediate_size=128)
    save_checkpoint(build_model(cfg), tmp_path)
    quantize_checkpoint(tmp_path, (128, 128))
    prompts = [[(7 * i + 3) % 500 for i in range(n)] for n in (21, 5, 13)]
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    runs = {}
    for mode in MODES:
        overlap = dataclasses.replace(
            mode_config(mode), tbo_min_tokens=1, moe_dispatch_dtype=dispatch
        )
        with LLM(tmp_path, overlap=overlap) as llm:
            banks = [m for m in llm.executor.runner.model.modules() if isinstance(m, ExpertBank)]
            fed.clear()
            runs[mode] = llm.generate(prompts, params, return_logits=True)
            assert bool(fed) == (dispatch == "fp8"), mode
            assert banks and all(b.w8a8 and b.w8a8.grouped and not b.w8a8.failed for b in banks)
            said = fp8_resident.expert_kernels(llm.executor.runner.model)
            assert said.startswith(f"{len(banks)} of {len(banks)} W8A8 expert banks as one Triton")
    with LLM(tmp_path, fp8_dequant_on_the_fly=True) as llm:  # no bank W8A8: nothing to say
        assert fp8_resident.expert_kernels(llm.executor.runner.model) is None
    for mode in MODES[1:]:
        for a, b in zip(runs["none"], runs[mode], strict=True):
            assert a.token_ids == b.token_ids, mode
            assert (a.prompt_logits - b.prompt_logits).abs().max().item() <= 1e-4, mode
