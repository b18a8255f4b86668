"""Least-squares fits of costs to measured times: the one calibration fit that ``--overlap
auto``'s start-up (``overlap/calibrate.py``) and ``plan --cluster this``
(``planner/calibration.py``) both run.

Every fit is non-negative, since a cost cannot pay time back, and minimises relative errors with
each column scaled to 1 first: FLOP counts dwarf sequence counts, and a 30 ms decode step must
count as much as a 300 ms prefill. The two callers fit different columns (docs/planner.md, "One
calibration fit"); the arithmetic is this module's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def nnls(x: torch.Tensor, y: torch.Tensor, required: tuple[int, ...] = ()) -> torch.Tensor:
    """Least squares with every coefficient >= 0: the best of the fits on each subset of the
    columns whose coefficients all come out non-negative (a handful of columns here). Subsets
    keep the ``required`` columns when some such fit exists (a CPU always pays for GEMMs)."""
    cols = x.shape[1]
    best, best_err = None, float("inf")
    for k in range(1, cols + 1):
        for subset in itertools.combinations(range(cols), k):
            if not set(required) <= set(subset):
                continue
            sol = torch.linalg.lstsq(x[:, subset], y[:, None]).solution[:, 0]
            if (sol < 0).any():
                continue
            err = float((x[:, subset] @ sol - y).square().sum())
            if err < best_err:
                best_err, best = err, torch.zeros(cols, dtype=x.dtype)
                best[list(subset)] = sol
    if best is None:
        return nnls(x, y) if required else torch.zeros(cols, dtype=x.dtype)
    return best


def fit_costs(
    rows: Sequence[Sequence[float]], targets: Sequence[float], required: tuple[int, ...] = ()
) -> list[float]:
    """Per column of ``rows`` (one row of features per measurement), the non-negative cost
    that minimises the relative errors against ``targets`` (seconds)."""
    if not rows:
        raise ValueError("fit_costs needs at least one measurement")
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    weight = 1 / y.abs().clamp_min(1e-9)
    scale = x.abs().amax(dim=0).clamp_min(1e-30)
    return (nnls(x / scale * weight[:, None], y * weight, required) / scale).tolist()


@dataclass(frozen=True)
class LinkFit:
    """An all-to-all's time as ``latency_s + bytes * s_per_byte``."""

    latency_s: float
    s_per_byte: float

    @property
    def bytes_per_s(self) -> float:
        """The link's rate; ``inf`` where the bytes cost nothing measurable."""
        return 1 / self.s_per_byte if self.s_per_byte > 0 else math.inf


def fit_link(transfers: Sequence[tuple[float, float]]) -> LinkFit:
    """The link from measured all-to-alls, each ``(bytes, seconds)``; a free link if none."""
    if not transfers:
        return LinkFit(0.0, 0.0)
    latency, per_byte = fit_costs([[1.0, b] for b, _ in transfers], [s for _, s in transfers])
    return LinkFit(latency, per_byte)
