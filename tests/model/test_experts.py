"""The expert bank: one batched matmul over padded experts or a matmul per expert, by load."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.model.expert_paths import batched_pays, padded_positions
from moe_overlap.model.moe import ExpertBank

EXPERTS, HIDDEN, INTER = 6, 48, 32


def bank() -> ExpertBank:
    gen = torch.Generator().manual_seed(0)
    b = ExpertBank(HIDDEN, INTER, first=0, count=EXPERTS)
    for p in b.parameters():
        p.data = torch.randn(p.shape, generator=gen) / HIDDEN**0.5
    return b


BANK = bank()


def per_expert(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The reference: each expert's rows through its own gate/up and down matmuls."""
    out, start = torch.empty_like(x), 0
    for e, n in enumerate(counts):
        gate, up = F.linear(x[start : start + n], BANK.gate_up_proj[e]).chunk(2, dim=-1)
        out[start : start + n] = F.linear(F.silu(gate) * up, BANK.down_proj[e])
        start += n
    return out


counts_st = st.lists(
    st.one_of(st.integers(0, 12), st.integers(0, 300)), min_size=EXPERTS, max_size=EXPERTS
)


@settings(max_examples=60, deadline=None)
@given(counts=counts_st, cut=st.integers(0, EXPERTS))
def test_any_load_matches_per_expert_and_blocks_are_bit_identical(counts, cut):
    x = torch.randn(sum(counts), HIDDEN)
    whole = BANK(x, counts)
    assert torch.allclose(whole, per_expert(x, counts), atol=1e-5, rtol=1e-5)
    blocks = torch.full_like(x, float("nan"))
    BANK.run_experts(x, counts, blocks, range(0, cut))
    BANK.run_experts(x, counts, blocks, range(cut, EXPERTS))
    assert torch.equal(whole, blocks)  # SBO's block-by-block experts are exact


def test_a_block_of_one_expert_gives_the_bits_of_the_whole_bank():
    # torch's bmm of a single 5-row matrix sums differently from the same matrix in a batch
    counts = [5, 0, 0, 0, 0, 0]
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    blocks = torch.full_like(x, float("nan"))
    BANK.run_experts(x, counts, blocks, range(0, 1))
    assert torch.equal(BANK(x, counts), blocks)


def test_no_rows_leaves_the_output_untouched():
    out = torch.full((0, HIDDEN), 1.0)
    BANK.run_experts(torch.empty(0, HIDDEN), [0] * EXPERTS, out, range(EXPERTS))
    assert out.shape == (0, HIDDEN)


def test_padded_positions_place_each_expert_rows_at_its_own_block():
    assert padded_positions([2, 0, 3], 3, torch.device("cpu")).tolist() == [0, 1, 6, 7, 8]


def test_batching_is_chosen_for_small_or_even_loads_only():
    assert batched_pays([8, 3, 0, 1], height=8)  # small: padding is cheap
    assert batched_pays([120, 128, 110, 125], height=128)  # even enough
    assert not batched_pays([128, 2, 2, 2], height=128)  # mostly padding
    assert not batched_pays([256] * 4, height=256)  # large: a matmul per expert is faster
