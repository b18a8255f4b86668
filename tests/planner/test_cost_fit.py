"""The one calibration fit (``core/cost_fit.py``) that auto and ``plan --cluster this`` share:
it recovers known costs, never returns a negative one, keeps what must be paid, and fits a
link's latency and rate."""

from __future__ import annotations

import math

import pytest

from moe_overlap.core.cost_fit import LinkFit, fit_costs, fit_link

# (FLOPs, sequences, 1) per measured forward: columns of very different sizes
ROWS = [[2e9, 1, 1], [6e9, 1, 1], [1.2e10, 1, 1], [4e9, 48, 1], [8e9, 8, 1]]


def seconds(costs: list[float], rows: list[list[float]] = ROWS) -> list[float]:
    return [sum(c * x for c, x in zip(costs, row, strict=True)) for row in rows]


def test_exact_measurements_give_back_their_costs() -> None:
    truth = [1e-11, 2e-4, 3e-3]  # 10 ps per FLOP, 0.2 ms per sequence, 3 ms per forward
    assert fit_costs(ROWS, seconds(truth)) == pytest.approx(truth, rel=1e-9)


def test_no_cost_comes_out_negative() -> None:
    # the times fall with the sequences: plain least squares would pay time back per sequence
    times = [t - 1e-4 * row[1] for t, row in zip(seconds([1e-11, 0, 5e-3]), ROWS, strict=True)]
    costs = fit_costs(ROWS, times)
    assert min(costs) >= 0
    assert costs[1] == 0


def test_a_required_cost_is_kept_where_a_fit_with_it_exists() -> None:
    # the times fall a little with the FLOPs: the best non-negative fit is a fixed cost alone,
    # but a machine always pays for its FLOPs
    rows = [[1.0, 1], [2.0, 1], [3.0, 1]]
    times = [1.02, 1.01, 1.0]
    assert fit_costs(rows, times)[0] == 0
    per_flop, fixed = fit_costs(rows, times, required=(0,))
    assert per_flop > 0 and fixed == 0


def test_errors_are_relative_so_short_steps_count() -> None:
    # one long forward 10% off, four short ones exact: the short ones decide the cost
    rows = [[1.0], [1.0], [1.0], [1.0], [100.0]]
    times = [1.0, 1.0, 1.0, 1.0, 110.0]
    assert fit_costs(rows, times)[0] == pytest.approx(1.0, rel=0.03)


def test_the_link_is_latency_plus_bytes_over_rate() -> None:
    latency, rate = 50e-6, 2e9
    transfers = [(b, latency + b / rate) for b in (1e5, 4e5, 1e6, 4e6)]
    link = fit_link(transfers)
    assert link.latency_s == pytest.approx(latency, rel=1e-6)
    assert link.bytes_per_s == pytest.approx(rate, rel=1e-6)


def test_no_transfer_is_a_free_link_and_no_measurement_is_refused() -> None:
    assert fit_link([]) == LinkFit(0.0, 0.0)
    assert math.isinf(LinkFit(0.0, 0.0).bytes_per_s)
    with pytest.raises(ValueError, match="at least one measurement"):
        fit_costs([], [])
