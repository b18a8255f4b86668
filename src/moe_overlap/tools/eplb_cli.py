"""``moe-overlap eplb-placement``: compute an EPLB placement offline from a recorded (or
hand-written) load, write it for ``--init-expert-location``, and print each layer's
balancedness before (the trivial placement) and after."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import cast

from rich.console import Console
from rich.table import Table

from moe_overlap.core.eplb_placement import (
    ALGORITHMS,
    AUTO,
    Algorithm,
    PlacementShape,
    balancedness,
    choose_algorithm,
    rebalance,
    trivial,
)
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import read_load, write_placement
from moe_overlap.engine.args import setting
from moe_overlap.tools.flags import add_fields


@dataclass
class EplbPlacementFlags:
    """``moe-overlap eplb-placement``: a recorded load in, a placement out."""

    distribution: str | None = setting(
        None,
        'the load: a JSON file {"load": [[tokens per logical expert] per layer]} (required)',
        metavar="JSON",
    )
    ep: int = setting(1, "expert-parallel ranks (GPUs) the slots spread over")
    num_redundant_experts: int = setting(
        0, "extra physical slots: E + R slots in all, R replicas of the hottest experts"
    )
    nodes: int = setting(
        1, "nodes the ranks are on (the hierarchical policy packs groups onto them)"
    )
    num_groups: int | None = setting(
        None,
        "expert groups (a grouped router's n_group); with groups dividing over --nodes, auto "
        "packs groups onto nodes first",
        parse=int,
    )
    algorithm: str = setting(
        AUTO,
        "deepseek (global), deepseek_hierarchical (groups to nodes to GPUs), or auto: "
        "hierarchical when --num-groups divide over --nodes, else global",
        choices=ALGORITHMS,
    )
    out: str | None = setting(
        None,
        'write {"physical_to_logical": [[logical expert per slot] per layer]} here, slots rank '
        "by rank (--init-expert-location takes it) (required)",
        metavar="JSON",
    )


def cmd_eplb_placement(args: argparse.Namespace) -> int:
    if not args.distribution or not args.out:
        raise ConfigError("eplb-placement needs --distribution JSON and --out JSON")
    load = read_load(args.distribution)
    experts = len(load[0])
    if any(len(row) != experts for row in load):
        raise ConfigError(f"--distribution {args.distribution}: every layer needs {experts} loads")
    if args.num_redundant_experts < 0:
        raise ConfigError(f"--num-redundant-experts {args.num_redundant_experts}: want >= 0")
    shape = PlacementShape(
        experts, experts + args.num_redundant_experts, args.ep, args.nodes, args.num_groups
    )
    algorithm = cast(Algorithm, args.algorithm)
    placement = rebalance(load, shape, algorithm)
    write_placement(args.out, placement)
    chosen = choose_algorithm(algorithm, args.num_groups, args.nodes)
    title = (
        f"{experts} experts + {args.num_redundant_experts} redundant over {args.ep} ranks on "
        f"{args.nodes} node(s), {chosen}: balancedness (mean rank load / max)"
    )
    table = Table(title=title)
    for column in ("layer", "before (trivial)", "after", "max/mean after"):
        table.add_column(column, justify="right")
    for layer, (row, slots) in enumerate(zip(load, placement, strict=True)):
        before = balancedness(trivial(shape), row, args.ep)
        after = balancedness(slots, row, args.ep)
        table.add_row(str(layer), f"{before:.3f}", f"{after:.3f}", f"{1 / after:.3f}")
    console = Console(width=max(Console().width, 100))
    console.print(table)
    console.print(f"wrote {args.out}")
    return 0


def add_eplb_command(sub: argparse._SubParsersAction) -> None:
    cmd = sub.add_parser(
        "eplb-placement",
        help="compute an expert placement (EPLB) from a recorded load",
        description="Replicate the hottest experts and pack the replicas onto ranks so each "
        "carries about the same load (DeepSeek's EPLB policies, then a local search); write "
        "the placement for --init-expert-location and print each layer's balancedness.",
    )
    add_fields(cmd, EplbPlacementFlags)
    cmd.set_defaults(func=cmd_eplb_placement)
