"""bench-serve's datasets: our workload grammar and vLLM's random and prefix_repetition."""

from __future__ import annotations

from moe_overlap.tools.bench_datasets import (
    FIRST_ID,
    prefix_repetition_requests,
    random_requests,
    workload_requests,
)

VOCAB = 50


def test_random_lengths_stay_in_the_range_after_the_shared_prefix():
    requests = random_requests(200, 40, 10, 0.5, 6, VOCAB, seed=1)
    prefix = requests[0].prompt[:6]
    for r in requests:
        assert r.prompt[:6] == prefix and 20 <= len(r.prompt) - 6 <= 60
        assert 5 <= r.output_len <= 15
        assert all(FIRST_ID <= t < VOCAB for t in r.prompt)
    assert len({len(r.prompt) for r in requests}) > 10  # the range is used, not one length
    fixed = random_requests(5, 40, 10, 0.0, 0, VOCAB, seed=1)
    assert {(len(r.prompt), r.output_len) for r in fixed} == {(40, 10)}
    assert random_requests(5, 40, 10, 0.5, 6, VOCAB, seed=1) == requests[:5]  # seeded


def test_prefix_repetition_takes_its_prefixes_in_turn():
    requests = prefix_repetition_requests(7, 5, 3, 3, 4, VOCAB, seed=0)
    prefixes = [r.prompt[:5] for r in requests]
    assert len({tuple(p) for p in prefixes}) == 3
    assert all(prefixes[i] == prefixes[i % 3] for i in range(7))
    assert all(len(r.prompt) == 8 and r.output_len == 4 for r in requests)


def test_the_workload_grammar_keeps_one_answer_length():
    requests = workload_requests("uniform:5-9", 10, 3, VOCAB, seed=0)
    assert all(5 <= len(r.prompt) <= 9 and r.output_len == 3 for r in requests)
