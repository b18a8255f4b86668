"""The one-pass FP8 kernels (``dispatch/fp8_wire_kernels.py``), run on CPU in Triton's
interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``): the FP8 dispatch's encode and
decode and W8A8's activations give the torch operations' bits, on every tie between
neighbouring FP8 values and on bf16 ties, subnormals and twelve orders of magnitude."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.dispatch.fp8_rows import FP8, Fp8Rows, kernels_match, one_pass
from moe_overlap.model.fp8_scale_layout import _quantize_in_one_pass, _quantize_torch

GRID = torch.arange(127, dtype=torch.uint8).view(FP8).float()  # every finite value, 0 .. 448


def hard_rows() -> torch.Tensor:
    """Rows of 256 (two groups) that round at every FP8 tie, either side of it, at each sign,
    and across magnitudes, with an all-zero group and a group of tiny values."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 256, generator=gen) * torch.logspace(-6, 6, 40)[:, None]
    ties = (GRID[1:] + GRID[:-1]) / 2  # scale 1: amax 448 leads each row
    for row, values in enumerate((ties, ties * (1 + 1e-6), ties * (1 - 1e-6), -ties)):
        x[row, :128] = torch.cat((torch.tensor([448.0]), values, torch.zeros(2)))[:128]
    x[5, 128:] = 0
    x[6, :128] = 1e-30
    return x


def test_the_check_passes_in_the_interpreter_and_is_never_taken_on_cpu():
    assert kernels_match(torch.device("cpu"))
    assert not one_pass(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_and_decode_in_one_pass_give_the_torch_paths_bytes(dtype):
    rows, x = Fp8Rows(256, dtype), hard_rows().to(dtype)
    wire = rows.encode_in_one_pass(x)
    assert torch.equal(wire, rows.encode(x))  # on CPU: the torch operations
    assert torch.equal(rows.decode_in_one_pass(wire), rows.decode(wire))


def test_decode_rounds_bf16_ties_to_even():
    """Scales of 1 + 2^-8 put FP8 values times the scale exactly halfway between two bf16
    values: the kernel's own rounding, not the cast's, decides them."""
    rows = Fp8Rows(128, torch.bfloat16)
    q = torch.cat((GRID, -GRID[1:]))[:128].repeat(4, 1)
    scale = torch.tensor([1 + 2**-8, 3 * (1 + 2**-8), 2**-20 * (1 + 2**-8), 0.0])[:, None]
    wire = torch.zeros(4, rows.width, dtype=torch.uint8)
    wire[:, :128] = q.to(FP8).view(torch.uint8)
    wire[:, 128:132] = scale.view(torch.uint8)
    assert torch.equal(rows.decode_in_one_pass(wire), rows.decode(wire))


@pytest.mark.parametrize("row_multiple", [1, 4])
def test_w8a8_activations_in_one_pass_give_the_torch_operations_bits(row_multiple):
    x = hard_rows()[:37]
    ours, theirs = _quantize_in_one_pass(x, row_multiple), _quantize_torch(x, row_multiple)
    assert ours[0].shape == theirs[0].shape and ours[1].stride() == theirs[1].stride()
    assert torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8))
    assert torch.equal(ours[1], theirs[1])
