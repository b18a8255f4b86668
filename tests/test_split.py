"""Split policies: reference examples and properties over thousands of random batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.overlap.split import (
    CostModel,
    balanced_seq_split,
    merge_logits,
    needs_two_chunk,
    plan_even_tokens,
    plan_two_batch,
    split_batch,
)


def extend_batch(lens, prefixes=None, all_logits=None, decode=False):
    n = len(lens)
    return ForwardBatch(
        torch.arange(sum(lens)) % 97,
        list(range(n)),
        prefixes or [0] * n,
        lens,
        all_logits or [False] * n,
        [decode] * n,
    )


def shapes(batch, threshold=0.48):
    return [
        (c.extend_lens, c.prefix_lens) for c in split_batch(batch, plan_two_batch(batch, threshold))
    ]


def test_reference_examples():
    assert shapes(extend_batch([100, 2000])) == [([100, 950], [0, 0]), ([1050], [950])]
    assert shapes(extend_batch([2900, 100])) == [([1500], [0]), ([1400, 100], [1500, 0])]
    assert shapes(extend_batch([3000])) == [([1500], [0]), ([1500], [1500])]


def test_two_chunk_disabled_keeps_sequences_whole():
    assert shapes(extend_batch([100, 2000]), 0) == [([100], [0]), ([2000], [0])]
    assert shapes(extend_batch([3000]), 0) == [([3000], [0]), ([], [])]


def test_decode_halves_the_sequences():
    b = extend_batch([1] * 5, prefixes=[7, 3, 9, 1, 4], decode=True)
    assert shapes(b) == [([1, 1, 1], [7, 3, 9]), ([1, 1], [1, 4])]


def test_threshold_edges():
    # balanced split [50 | 50 + 4] gives a left share of 50/104 = 0.4808
    lens = [50, 50, 4]
    assert balanced_seq_split(lens) == 1
    assert not needs_two_chunk(lens, 0.48)
    assert needs_two_chunk(lens, 0.481)
    assert needs_two_chunk([30, 70], 0.31) and not needs_two_chunk([30, 70], 0.30)
    assert not needs_two_chunk([1, 1000], 0)


lens_st = st.lists(st.integers(1, 400), min_size=1, max_size=12)


def check_children(batch, plan):
    children = split_batch(batch, plan)
    seen = {}  # sequence -> list of (prefix, extend) pieces in child order
    for child in children:
        for slot, prefix, n in zip(child.slots, child.prefix_lens, child.extend_lens, strict=True):
            seen.setdefault(slot, []).append((prefix, n))
    # no token lost or duplicated; pieces of a sequence are contiguous and in order
    for seq, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens, strict=True)):
        pos = prefix
        for p, m in seen[seq]:
            assert p == pos and m > 0
            pos += m
        assert pos == prefix + n
    assert torch.equal(torch.cat([c.input_ids for c in children]), batch.input_ids)
    assert sum(c.num_tokens for c in children) == batch.num_tokens
    return children


@settings(max_examples=1500, deadline=None)
@given(
    lens=lens_st,
    prefixes=st.lists(st.integers(0, 50), min_size=12, max_size=12),
    threshold=st.sampled_from([0, 0.1, 0.3, 0.48, 0.5]),
)
def test_two_batch_split_properties(lens, prefixes, threshold):
    batch = extend_batch(lens, prefixes[: len(lens)])
    children = check_children(batch, plan_two_batch(batch, threshold))
    assert len(children) == 2
    total = batch.num_tokens
    if needs_two_chunk(lens, threshold):  # two-chunk: both halves within one token
        assert [c.num_tokens for c in children] == [total // 2, total - total // 2]
    else:  # sequence level: no sequence is cut
        assert sum(c.num_seqs for c in children) == len(lens)
        if len(lens) > 1:
            assert children[0].num_seqs > 0 and children[1].num_seqs > 0
    if threshold and total >= 2:  # the promise of two-chunk: no idle micro-batch
        assert all(c.num_tokens > 0 for c in children)


@settings(max_examples=800, deadline=None)
@given(lens=lens_st, parts=st.integers(2, 5))
def test_even_token_split_properties(lens, parts):
    batch = extend_batch(lens)
    children = check_children(batch, plan_even_tokens(batch, parts))
    counts = [c.num_tokens for c in children]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=500, deadline=None)
@given(
    lens=lens_st,
    flags=st.lists(st.booleans(), min_size=12, max_size=12),
    threshold=st.sampled_from([0, 0.48]),
)
def test_merge_logits_restores_the_parent_rows(lens, flags, threshold):
    batch = extend_batch(lens, all_logits=flags[: len(lens)])
    plan = plan_two_batch(batch, threshold)
    children = split_batch(batch, plan)

    # fake logits: one row per token, holding (slot, position) so rows are identifiable
    def fake(b):
        rows = b.logit_rows()
        pos = b.positions
        slot = torch.repeat_interleave(
            torch.tensor(b.slots, dtype=torch.long), torch.tensor(b.extend_lens, dtype=torch.long)
        )
        return (
            torch.stack([slot[rows], pos[rows]], dim=1).float() if len(rows) else torch.zeros(0, 2)
        )

    assert torch.equal(merge_logits(batch, plan, [fake(c) for c in children]), fake(batch))


COST = CostModel(per_token=1000.0, per_pair=1.0)


@settings(max_examples=600, deadline=None)
@given(lens=lens_st, prefixes=st.lists(st.integers(0, 300), min_size=12, max_size=12))
def test_time_balanced_two_chunk_properties(lens, prefixes):
    batch = extend_batch(lens, prefixes[: len(lens)])
    if not needs_two_chunk(lens, 0.48):
        return
    plan = plan_two_batch(batch, 0.48, COST)
    children = check_children(batch, plan)
    assert all(c.num_tokens > 0 for c in children)
    a, b = (COST.cost(batch, child) for child in plan)
    # moving the cut by one token changes each side by at most one token's cost
    one_token = COST.per_token + COST.per_pair * (max(prefixes) + sum(lens))
    assert abs(a - b) <= one_token


def test_time_balanced_cut_gives_the_first_chunk_more_tokens():
    plan = plan_two_batch(extend_batch([3072]), 0.48, COST)
    first, second = (sum(p.length for p in child) for child in plan)
    assert first > second and first + second == 3072


@settings(max_examples=600, deadline=None)
@given(
    lens=lens_st,
    prefixes=st.lists(st.integers(0, 300), min_size=12, max_size=12),
    parts=st.integers(2, 5),
)
def test_time_balanced_n_way_split_properties(lens, prefixes, parts):
    batch = extend_batch(lens, prefixes[: len(lens)])
    if batch.num_tokens < parts:
        return
    plan = plan_even_tokens(batch, parts, COST)
    children = check_children(batch, plan)
    assert len(children) == parts and all(c.num_tokens > 0 for c in children)
    costs = [COST.cost(batch, child) for child in plan]
    one_token = COST.per_token + COST.per_pair * (max(prefixes) + sum(lens))
    if batch.num_tokens >= 4 * parts:  # enough tokens that the quantile cuts are unconstrained
        assert max(costs) - min(costs) <= 2 * one_token


def test_later_chunks_of_one_request_get_fewer_tokens():
    plan = plan_even_tokens(extend_batch([3072]), 4, COST)
    sizes = [sum(p.length for p in child) for child in plan]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == 3072
