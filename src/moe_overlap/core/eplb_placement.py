"""Where each expert's replicas go: DeepSeek's published EPLB policies, written here from their
description. Replicate the hottest experts, then pack the replicas onto GPUs so every GPU
carries about the same load; the hierarchical policy first packs expert groups onto nodes, so
group-limited routing keeps its traffic within a node.

A placement is one list per layer, ``physical_to_logical``: the logical expert each physical
slot holds, slots ordered rank by rank (GPU g holds slots ``g*S .. g*S+S-1``). Two replicas of
one expert never share a GPU (a replica there would serve nothing its twin does not)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from moe_overlap.core.eplb_refine import WIDE_SLOTS, refine_with_kicks
from moe_overlap.core.errors import ConfigError

Algorithm = Literal["auto", "deepseek", "deepseek_hierarchical"]
ALGORITHMS: tuple[Algorithm, ...] = ("auto", "deepseek", "deepseek_hierarchical")
AUTO: Algorithm = ALGORITHMS[0]  # as SGLang chooses: hierarchical where the groups divide


@dataclass(frozen=True)
class PlacementShape:
    """The sizes a placement is computed for: experts, physical slots, GPUs, nodes, groups."""

    num_experts: int
    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int | None = None

    def __post_init__(self) -> None:
        e, s, g, n = self.num_experts, self.num_slots, self.num_gpus, self.num_nodes
        if min(e, g, n) < 1 or s < e:
            raise ConfigError(
                f"EPLB: {e} experts, {s} slots, {g} GPUs, {n} nodes: want at least one of each "
                "and at least one slot per expert (slots = experts + redundant experts)"
            )
        if s % g or g % n:
            raise ConfigError(
                f"EPLB: {s} slots over {g} GPUs on {n} nodes: the slots must divide over the "
                "GPUs and the GPUs over the nodes; change --num-redundant-experts or --nodes"
            )
        if self.num_groups is not None and (self.num_groups < 1 or e % self.num_groups):
            raise ConfigError(
                f"EPLB: {self.num_groups} expert groups do not divide {e} experts; pass the "
                "model's n_group as --num-groups, or leave it out"
            )

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus


def choose_algorithm(algorithm: Algorithm, num_groups: int | None, num_nodes: int) -> Algorithm:
    """``auto`` as SGLang chooses: hierarchical when the expert groups divide over the nodes."""
    if algorithm != AUTO:
        return algorithm
    if num_groups is not None and num_groups % num_nodes == 0:
        return "deepseek_hierarchical"
    return "deepseek"


def rebalance(
    load: list[list[float]],
    shape: PlacementShape,
    algorithm: Algorithm = AUTO,
    refined: bool = True,
) -> list[list[int]]:
    """``physical_to_logical`` for every layer of ``load`` (tokens per logical expert):
    the published policy, then (``refined``) ``eplb_refine.refine``'s local search."""
    chosen = choose_algorithm(algorithm, shape.num_groups, shape.num_nodes)
    groups, nodes = (shape.num_groups, shape.num_nodes) if chosen != "deepseek" else (1, 1)
    if groups is None or groups % nodes:
        raise ConfigError(
            f"EPLB: the hierarchical policy packs expert groups onto nodes: {groups} groups "
            f"over {nodes} nodes does not divide; use --algorithm deepseek (global)"
        )
    if shape.slots_per_gpu > shape.num_experts // nodes:
        raise ConfigError(
            f"EPLB: {shape.slots_per_gpu} slots per GPU but only {shape.num_experts // nodes} "
            "experts per node: two replicas of one expert would share a GPU; use fewer "
            "redundant experts"
        )
    for row in load:
        if len(row) != shape.num_experts or min(row) < 0:
            raise ConfigError(
                f"EPLB: a layer's load has {len(row)} entries (want {shape.num_experts}, one "
                "non-negative count per logical expert)"
            )
    return [_place_layer([float(x) for x in row], shape, groups, nodes, refined) for row in load]


def _place_layer(
    load: list[float], shape: PlacementShape, groups: int, nodes: int, refined: bool
) -> list[int]:
    group_size = shape.num_experts // groups
    group_load = [sum(load[g * group_size : (g + 1) * group_size]) for g in range(groups)]
    node_groups = pack(group_load, list(range(groups)), nodes, groups // nodes)
    gpus_per_node = shape.num_gpus // nodes
    placement: list[int] = []
    for node in node_groups:
        experts = [g * group_size + i for g in node for i in range(group_size)]
        node_load = [load[e] for e in experts]
        local = _place_node(node_load, shape.num_slots // nodes, gpus_per_node, refined)
        placement.extend(experts[r] for r in local)
    return placement


def _place_node(load: list[float], num_slots: int, num_gpus: int, refined: bool) -> list[int]:
    # refined: on small placements, the greedy placement for each cap on replicas per expert and
    # the round-robin one, each refined, and the best of them
    small = refined and num_slots <= WIDE_SLOTS
    caps = range(1, num_gpus + 1) if small else [num_gpus]
    starts = [
        _greedy(load, num_slots, num_gpus, cap) for cap in caps if cap * len(load) >= num_slots
    ]
    if small:
        starts.append([i % len(load) for i in range(num_slots)])
    best: tuple[float, list[int]] | None = None
    for local in starts:
        if refined:
            local = refine_with_kicks(local, load, num_gpus, num_gpus)
        peak = max(gpu_loads(local, load, num_gpus))
        if best is None or peak < best[0] - 1e-9:
            best = (peak, local)
    assert best is not None  # cap = num_gpus always fits: checked in rebalance
    return best[1]


def _greedy(load: list[float], num_slots: int, num_gpus: int, cap: int) -> list[int]:
    # the published policy within one node: replicate, then pack
    replicas = replicate(load, num_slots, cap)
    count = Counter(replicas)
    weights = [load[r] / count[r] for r in replicas]
    packed = pack(weights, replicas, num_gpus, num_slots // num_gpus)
    return [replicas[item] for gpu in packed for item in gpu]


def replicate(load: list[float], num_slots: int, cap: int) -> list[int]:
    """Each slot's expert: every expert once, then the extra slots one at a time to the expert
    with the most load per replica, none past ``cap`` replicas (the GPUs it may spread over)."""
    slots = list(range(len(load)))
    count = [1] * len(load)
    for _ in range(num_slots - len(load)):
        open_ = [e for e in range(len(load)) if count[e] < cap]
        hottest = max(open_, key=lambda e: (load[e] / count[e], -e))
        slots.append(hottest)
        count[hottest] += 1
    return slots


def pack(weights: list[float], kinds: list[int], num_packs: int, per_pack: int) -> list[list[int]]:
    """Items (indices into ``weights``) into ``num_packs`` packs of ``per_pack``: heaviest first,
    each to the lightest pack with room and no item of its kind; when every pack with room has
    one, an item of a full pack moves over to make room."""
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        kind = kinds[item]
        fits = [
            p
            for p in range(num_packs)
            if len(packs[p]) < per_pack and all(kinds[i] != kind for i in packs[p])
        ]
        if fits:
            target = min(fits, key=lambda p: (totals[p], p))
        else:
            target = _make_room(packs, totals, weights, kinds, kind, per_pack)
        packs[target].append(item)
        totals[target] += weights[item]
    return packs


def _make_room(
    packs: list[list[int]],
    totals: list[float],
    weights: list[float],
    kinds: list[int],
    kind: int,
    per_pack: int,
) -> int:
    # a full pack without `kind` gives one item to a pack with room that lacks that item's kind
    # (one always exists: the full pack holds per_pack kinds, the open one fewer)
    best: tuple[float, int, int, int] | None = None
    for full, items in enumerate(packs):
        if len(items) < per_pack or any(kinds[i] == kind for i in items):
            continue
        for open_, room in enumerate(packs):
            if len(room) >= per_pack:
                continue
            for item in items:
                if all(kinds[i] != kinds[item] for i in room):
                    cost = max(totals[full] - weights[item], totals[open_] + weights[item])
                    if best is None or cost < best[0]:
                        best = (cost, full, open_, item)
    if best is None:
        raise ConfigError("EPLB: no GPU can take another replica; use fewer redundant experts")
    _, full, open_, item = best
    packs[full].remove(item)
    totals[full] -= weights[item]
    packs[open_].append(item)
    totals[open_] += weights[item]
    return full


def trivial(shape: PlacementShape) -> list[int]:
    """SGLang's trivial placement: slot i holds expert ``i % E`` (the round-robin baseline)."""
    return [i % shape.num_experts for i in range(shape.num_slots)]


def gpu_loads(placement: list[int], load: list[float], num_gpus: int) -> list[float]:
    """Each GPU's tokens when every expert's load splits evenly over its replicas."""
    count = Counter(placement)
    per_gpu = len(placement) // num_gpus
    return [
        sum(load[e] / count[e] for e in placement[g * per_gpu : (g + 1) * per_gpu])
        for g in range(num_gpus)
    ]


def balancedness(placement: list[int], load: list[float], num_gpus: int) -> float:
    """vLLM's measure: the mean GPU load over the largest (1.0 is perfect balance)."""
    loads = gpu_loads(placement, load, num_gpus)
    return sum(loads) / len(loads) / max(loads) if max(loads) > 0 else 1.0
