"""EPLB placement: DeepSeek's published example, the invariants, and balance against the
round-robin baseline and a brute-force optimum."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.eplb_placement import (
    PlacementShape,
    balancedness,
    choose_algorithm,
    gpu_loads,
    rebalance,
    trivial,
)
from moe_overlap.core.errors import ConfigError

# the example in deepseek-ai/EPLB's README: 2 layers of 12 experts in 4 groups, 16 replicas on
# 2 nodes of 4 GPUs
README_LOAD = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PLACEMENT = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def test_the_published_example() -> None:
    shape = PlacementShape(num_experts=12, num_slots=16, num_gpus=8, num_nodes=2, num_groups=4)
    assert choose_algorithm("auto", 4, 2) == "deepseek_hierarchical"
    assert rebalance(README_LOAD, shape, refined=False) == README_PLACEMENT
    # the local search keeps each group on its node and never lowers balance
    refined = rebalance(README_LOAD, shape)
    for layer, load in enumerate(README_LOAD):
        for node in range(2):
            half = slice(node * 8, node * 8 + 8)
            assert {e // 3 for e in refined[layer][half]} == {
                e // 3 for e in README_PLACEMENT[layer][half]
            }
        assert balancedness(refined[layer], load, 8) >= balancedness(
            README_PLACEMENT[layer], load, 8
        )


def _check_invariants(placement: list[int], shape: PlacementShape) -> None:
    per = shape.slots_per_gpu
    assert len(placement) == shape.num_slots
    assert set(placement) == set(range(shape.num_experts))
    for g in range(shape.num_gpus):
        gpu = placement[g * per : (g + 1) * per]
        assert len(set(gpu)) == per, f"two replicas of one expert on GPU {g}: {gpu}"


@settings(max_examples=25, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda gpus: st.tuples(
            st.just(gpus),
            st.integers(1, 3),  # slots per GPU
            st.sampled_from([(1, None), (1, 1), (2, 2), (2, 4)]),  # nodes, groups
            st.data(),
        )
    )
)
def test_invariants(case: tuple) -> None:
    gpus, per, (nodes, groups), data = case
    if gpus % nodes:
        nodes = 1
    slots = gpus * per
    experts = data.draw(st.integers(max(per * nodes, 2), slots))
    if groups is not None and experts % groups:
        groups = None
    shape = PlacementShape(experts, slots, gpus, nodes, groups)
    load = data.draw(st.lists(st.integers(0, 1000), min_size=experts, max_size=experts))
    for algorithm in ("auto", "deepseek"):
        try:
            placement = rebalance([load], shape, algorithm)[0]
        except ConfigError as e:  # refused shapes name themselves
            assert "EPLB" in str(e)
            continue
        _check_invariants(placement, shape)
        assert sum(Counter(placement).values()) == experts + (slots - experts)


def _zipf(rng: random.Random, experts: int) -> list[float]:
    s = rng.uniform(0.8, 2.0)
    ranks = rng.sample(range(1, experts + 1), experts)
    return [1000 / r**s * rng.uniform(0.5, 1.5) for r in ranks]


def _replica_counts(experts: int, slots: int, cap: int) -> list[tuple[int, ...]]:
    if experts == 1:
        return [(slots,)] if 1 <= slots <= cap else []
    return [
        (c, *rest)
        for c in range(1, min(cap, slots - experts + 1) + 1)
        for rest in _replica_counts(experts - 1, slots - c, cap)
    ]


def _lowest_peak(items: list[tuple[int, float]], held: list[list[int]], per: int) -> float:
    # the lowest largest GPU load of the items packed onto GPUs already holding `held`
    best = float("inf")
    totals = [0.0] * len(held)

    def place(k: int) -> None:
        nonlocal best
        if k == len(items):
            best = min(best, max(totals))
            return
        e, w = items[k]
        seen = set()
        for g, gpu in enumerate(held):
            key = tuple(sorted(gpu))
            if len(gpu) < per and e not in gpu and key not in seen:
                seen.add(key)
                if max(totals[g] + w, *totals) < best:
                    gpu.append(e)
                    totals[g] += w
                    place(k + 1)
                    gpu.pop()
                    totals[g] -= w

    place(0)
    return best


def _optimum(load: list[float], slots: int, gpus: int) -> float:
    # the best balancedness over every placement with each expert on distinct GPUs
    peak = min(
        _lowest_peak(
            [(e, load[e] / c) for e, c in enumerate(count) for _ in range(c)],
            [[] for _ in range(gpus)],
            slots // gpus,
        )
        for count in _replica_counts(len(load), slots, gpus)
    )
    return sum(load) / gpus / peak


def test_balance_against_round_robin_and_brute_force() -> None:
    rng = random.Random(0)
    sizes = [(4, 2, 2), (4, 3, 2), (6, 2, 2), (6, 3, 0), (6, 3, 3), (6, 4, 2), (5, 3, 1)]
    for _ in range(100):
        experts, gpus, redundant = rng.choice(sizes)
        load = _zipf(rng, experts)
        shape = PlacementShape(experts, experts + redundant, gpus)
        placement = rebalance([load], shape)[0]
        _check_invariants(placement, shape)
        got = balancedness(placement, load, gpus)
        assert got >= balancedness(trivial(shape), load, gpus) - 1e-9
        assert got >= 0.98 * _optimum(load, experts + redundant, gpus), (load, placement)


def test_large_zipf_beats_round_robin() -> None:
    rng = random.Random(1)
    load = [_zipf(rng, 32)]
    for nodes, groups in ((1, None), (2, 8)):
        shape = PlacementShape(32, 40, 8, nodes, groups)
        for layer, placement in zip(load, rebalance(load, shape), strict=True):
            _check_invariants(placement, shape)
            before = balancedness(trivial(shape), layer, 8)
            assert balancedness(placement, layer, 8) > before
            assert sum(gpu_loads(placement, layer, 8)) == pytest.approx(sum(layer))


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="divide over the GPUs"):
        PlacementShape(8, 10, 4)
    with pytest.raises(ConfigError, match="share a GPU"):
        rebalance([[1.0] * 4], PlacementShape(4, 12, 2))
    with pytest.raises(ConfigError, match="--algorithm deepseek"):
        rebalance([[1.0] * 8], PlacementShape(8, 8, 4, 2, None), "deepseek_hierarchical")
    with pytest.raises(ConfigError, match="want 8"):
        rebalance([[1.0] * 7], PlacementShape(8, 8, 4))
