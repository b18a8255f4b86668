"""``unsort``: undoing a sort of rows, by one indexed assignment for a decode step's few rows
and by a gather of whole rows for a prefill's many (CUDA's indexed assignment runs an
element-wise kernel); the same bits either way."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.core.dispatcher import GATHER_ROWS, inverse_permutation, unsort
from moe_overlap.tools.device_ops import DeviceOpCounter


@pytest.mark.parametrize("n", [0, 1, 7, GATHER_ROWS - 1, GATHER_ROWS, GATHER_ROWS + 37])
def test_unsort_gives_back_the_rows_before_the_sort(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 24, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(n, generator=gen)
    assert torch.equal(unsort(x[perm], perm), x)
    inv = inverse_permutation(perm)
    assert torch.equal(inv[perm], torch.arange(n))


@pytest.mark.parametrize("n, kernel", [(64, "index_put_"), (GATHER_ROWS, "index")])
def test_many_rows_are_gathered_and_few_assigned(n, kernel):
    x = torch.empty(n, 2048, device="meta")
    perm = torch.empty(n, dtype=torch.long, device="meta")
    with DeviceOpCounter() as counter:
        unsort(x, perm)
    assert counter.ops[kernel] == 1
    assert sum(counter.ops.values()) == (1 if kernel == "index_put_" else 3)
