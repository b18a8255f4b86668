"""Split policies: reference examples and properties over thousands of random batches."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.overlap.split import (
    balanced_seq_split,
    half_token_seq,
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
    # one sequence: SGLang's balanced split returns 0, so the first micro-batch is the empty one
    assert shapes(extend_batch([3000]), 0) == [([], []), ([3000], [0])]


def test_decode_gives_the_first_micro_batch_the_smaller_half():
    # SGLang: (num_tokens // token_num_per_seq) // 2 sequences go to the first micro-batch
    b = extend_batch([1] * 5, prefixes=[7, 3, 9, 1, 4], decode=True)
    assert shapes(b) == [([1, 1], [7, 3]), ([1, 1, 1], [9, 1, 4])]


def test_balanced_split_takes_the_later_cut_on_a_tie():
    assert balanced_seq_split([1, 2, 1]) == 2  # cuts 1 and 2 both leave a gap of 2
    assert balanced_seq_split([3, 3]) == 1
    assert balanced_seq_split([5]) == 0 and balanced_seq_split([]) == 0


def test_one_token_sequences_fall_back_to_the_sequence_split():
    # two-chunk would give the first micro-batch more sequences than tokens (SGLang 0.5.x)
    assert not needs_two_chunk([1, 2], 0.48) and not needs_two_chunk([1], 0.48)
    assert half_token_seq([1, 1, 1]) == 1 and not needs_two_chunk([1, 1, 1], 0.48)
    assert shapes(extend_batch([1, 1, 1])) == [([1, 1], [0, 0]), ([1], [0])]
    assert shapes(extend_batch([1])) == [([], []), ([1], [0])]
    assert needs_two_chunk([2], 0.48) and needs_two_chunk([1, 3], 0.48)


def test_threshold_edges():
    # balanced split [50 | 50 + 4] gives a left share of 50/104 = 0.4808
    lens = [50, 50, 4]
    assert balanced_seq_split(lens) == 1
    assert not needs_two_chunk(lens, 0.48)
    assert needs_two_chunk(lens, 0.481)
    assert needs_two_chunk([30, 70], 0.31) and not needs_two_chunk([30, 70], 0.30)
    assert not needs_two_chunk([48, 52], 0.48)  # strict: exactly on the threshold is balanced
    assert not needs_two_chunk([1, 1000], 0)
    # SGLang compares left > total * (1 - th) in floats: 63 > 90 * 0.7 == 62.99999999999999
    assert needs_two_chunk([63, 27], 0.3)


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


@settings(max_examples=500, deadline=None)
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
    else:  # sequence level: no sequence is cut, and only a lone sequence leaves a side empty
        assert sum(c.num_seqs for c in children) == len(lens)
        assert children[1].num_seqs > 0
        assert (children[0].num_seqs > 0) == (len(lens) > 1)
    if threshold and total >= 2:  # the promise of two-chunk: no idle micro-batch
        assert all(c.num_tokens > 0 for c in children)


@settings(max_examples=300, deadline=None)
@given(lens=lens_st, threshold=st.sampled_from([0, 0.1, 0.3, 0.48, 0.5]))
def test_split_choice_properties(lens, threshold):
    n, total = len(lens), sum(lens)
    gaps = {i: abs(2 * sum(lens[:i]) - total) for i in range(1, n)}
    best = balanced_seq_split(lens)  # the latest of the cuts with the smallest gap
    assert best == (max(i for i in gaps if gaps[i] == min(gaps.values())) if gaps else 0)
    left = sum(lens[:best])
    lopsided = left < total * threshold or left > total * (1 - threshold)
    s = half_token_seq(lens)  # SGLang's first child: sequences [0, s], total // 2 tokens
    assert sum(lens[:s]) <= total // 2 < sum(lens[: s + 1])
    assert needs_two_chunk(lens, threshold) == (lopsided and s + 1 <= total // 2)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40))
def test_decode_split_properties(n):
    batch = extend_batch([1] * n, decode=True)
    children = check_children(batch, plan_two_batch(batch, 0.48))
    assert [c.num_seqs for c in children] == [n // 2, n - n // 2]


@settings(max_examples=250, deadline=None)
@given(lens=lens_st, parts=st.integers(2, 5))
def test_even_token_split_properties(lens, parts):
    batch = extend_batch(lens)
    children = check_children(batch, plan_even_tokens(batch, parts))
    counts = [c.num_tokens for c in children]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=150, deadline=None)
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


COST = ModelFlops(per_token=1000.0, per_pair=1.0, expert_share=0.5, shared_share=0.0)


@settings(max_examples=200, deadline=None)
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


@settings(max_examples=200, deadline=None)
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
