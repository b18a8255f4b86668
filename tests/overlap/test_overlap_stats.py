"""The hidden-communication share read off a timeline: interval arithmetic and its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.overlap_stats import intersect, overlap_stats, subtract, union
from moe_overlap.core.timeline import Span


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2), (3, 5)], [(1, 4)]) == [(1, 2), (3, 4)]
    assert subtract([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]


@pytest.mark.parametrize(
    ("spans", "compute", "comm", "hidden"),
    [
        # no overlap: compute, then a wait that covers the all-to-all
        ([("mb0", 0, 10), ("mb0 wait", 6, 10), ("comm", 6, 10)], 6, 4, 0),
        # the other micro-batch computes while mb0's all-to-all flies
        ([("mb0", 0, 4), ("mb1", 4, 8), ("comm", 4, 7)], 8, 3, 3),
        # a receive hook's wait is not compute, even inside a segment
        ([("mb1", 0, 10), ("mb1 wait", 2, 5), ("comm", 0, 5)], 7, 5, 2),
        # nested spans (an SBO block inside its stage) count once
        ([("mb0", 0, 10), ("mb0 sbo", 2, 4), ("comm", 3, 12)], 10, 9, 7),
    ],
)
def test_overlap_stats_cases(spans, compute, comm, hidden):
    stats = overlap_stats([Span(t, "x", a, b) for t, a, b in spans])
    assert (stats.compute_s, stats.comm_s, stats.hidden_s) == (compute, comm, hidden)


span = st.tuples(
    st.sampled_from(["mb0", "mb1", "mb0 wait", "mb1 wait", "mb0 sbo", "comm"]),
    st.floats(0, 100, allow_nan=False),
    st.floats(0, 50, allow_nan=False),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(span, max_size=30))
def test_hidden_share_never_exceeds_100_percent(raw):
    stats = overlap_stats([Span(t, "x", a, a + d) for t, a, d in raw])
    assert 0 <= stats.hidden_s <= stats.comm_s + 1e-9
    assert stats.hidden_s <= stats.compute_s + 1e-9
    share = stats.hidden_share
    assert share is None or 0 <= share <= 1 + 1e-9
