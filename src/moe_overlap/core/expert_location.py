"""EPLB's files and the map a rank dispatches by. A distribution file is
``{"load": [[tokens per logical expert] per layer]}``; a placement file is
``{"physical_to_logical": [[logical expert per physical slot] per layer]}``, slots ordered rank
by rank. ``--init-expert-location`` takes either (a distribution is placed with
``eplb_placement.rebalance``) or ``trivial``: slot i holds expert ``i % E``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from moe_overlap.core.eplb_placement import AUTO, Algorithm, PlacementShape, rebalance, trivial
from moe_overlap.core.errors import ConfigError, is_finite_number, is_int

TRIVIAL = "trivial"
DISPATCH_ALGORITHMS = ("static", "dynamic")


def read_json(path: str, key: str) -> list[list]:
    """The per-layer rows under ``key`` in the JSON file ``path``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"EPLB file {path}: {e}") from None
    rows = data.get(key) if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
        raise ConfigError(
            f"EPLB file {path}: want {{{key!r}: [[...] per layer]}} with at least one layer"
        )
    return rows


def read_load(path: str) -> list[list[float]]:
    """A distribution file's load: tokens per logical expert per layer, non-negative numbers."""
    rows = read_json(path, "load")
    if not all(is_finite_number(x) and x >= 0 for r in rows for x in r):
        raise ConfigError(f"EPLB file {path}: the load must be non-negative numbers")
    return [[float(x) for x in r] for r in rows]


def write_placement(path: str, placement: list[list[int]]) -> None:
    Path(path).write_text(json.dumps({"physical_to_logical": placement}) + "\n")


def check_placement(placement: list[list[int]], shape: PlacementShape, where: str) -> None:
    """Refuse a placement whose slots, experts or GPUs do not fit ``shape``."""
    per = shape.slots_per_gpu
    for layer, row in enumerate(placement):
        if len(row) != shape.num_slots or not all(is_int(e) for e in row):
            raise ConfigError(
                f"{where}: layer {layer} has {len(row)} slots; want {shape.num_slots} (experts "
                "+ --ep-num-redundant-experts) logical expert ids"
            )
        if set(row) != set(range(shape.num_experts)):
            raise ConfigError(
                f"{where}: layer {layer} must hold every expert 0..{shape.num_experts - 1} and "
                "no other"
            )
        for g in range(shape.num_gpus):
            if len(set(row[g * per : (g + 1) * per])) < per:
                raise ConfigError(
                    f"{where}: layer {layer} puts two replicas of one expert on rank {g}"
                )


def initial_placement(
    location: str, shape: PlacementShape, num_layers: int, algorithm: Algorithm = AUTO
) -> list[list[int]]:
    """``--init-expert-location``'s placement: one row per MoE layer."""
    if location == TRIVIAL:
        placement = [trivial(shape)] * num_layers
        check_placement(placement, shape, "--ep-num-redundant-experts (trivial placement)")
        return placement
    try:
        data = json.loads(Path(location).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--init-expert-location {location}: {e}") from None
    if isinstance(data, dict) and "load" in data:
        placement = rebalance(read_load(location), shape, algorithm)
    else:
        placement = read_json(location, "physical_to_logical")
    if len(placement) != num_layers:
        raise ConfigError(
            f"--init-expert-location {location}: {len(placement)} layers; the model has "
            f"{num_layers} MoE layers"
        )
    check_placement(placement, shape, f"--init-expert-location {location}")
    return placement


@dataclass(frozen=True)
class ExpertPlacement:
    """Every MoE layer's ``physical_to_logical`` (``rows[i]`` for layer ``moe_layers[i]``) and
    how a token picks among an expert's replicas: ``static`` (the replica nearest its rank) or
    ``dynamic`` (spread over the replicas by token)."""

    moe_layers: tuple[int, ...]
    rows: tuple[tuple[int, ...], ...]
    dispatch: str = "static"
    # online EPLB (--enable-eplb): the shape and policy a rebalance places with (None: off)
    online: PlacementShape | None = None
    algorithm: Algorithm = AUTO

    @property
    def num_slots(self) -> int:
        return len(self.rows[0])

    def row(self, layer_id: int) -> tuple[int, ...]:
        return self.rows[self.moe_layers.index(layer_id)]

    def moved(self, rows: dict[int, tuple[int, ...]]) -> ExpertPlacement:
        """This placement with the layers of ``rows`` (by layer id) replaced."""
        new = tuple(
            rows.get(layer, row) for layer, row in zip(self.moe_layers, self.rows, strict=True)
        )
        return replace(self, rows=new)


def make_placement(
    moe_layers: list[int],
    shape: PlacementShape,
    location: str,
    dispatch: str,
    algorithm: Algorithm = AUTO,
    online: bool = False,
) -> ExpertPlacement | None:
    """The engine's placement from its flags; None where every rank holds its E/ep experts in
    order and dispatch needs no map (no redundant slot, the trivial location, no ``online``
    rebalancing, which moves experts and so always dispatches through the map)."""
    if dispatch not in DISPATCH_ALGORITHMS:
        raise ConfigError(
            f"--ep-dispatch-algorithm={dispatch!r} must be one of {', '.join(DISPATCH_ALGORITHMS)}"
        )
    if location == TRIVIAL and shape.num_slots == shape.num_experts and not online:
        return None
    rows = tuple(tuple(r) for r in initial_placement(location, shape, len(moe_layers), algorithm))
    return ExpertPlacement(tuple(moe_layers), rows, dispatch, shape if online else None, algorithm)
