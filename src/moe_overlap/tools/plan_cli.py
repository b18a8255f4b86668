"""``moe-overlap plan``: predict every overlap mode on a cluster, from a config.json alone.

``--cluster this`` first measures this machine (the engine's ranks over ``--link``: no-overlap
forwards of prefill and decode shapes, and a tiny decode with and without two micro-batches;
see ``planner/calibration.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import cast

from rich.console import Console

from moe_overlap.core.eplb_placement import Algorithm
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.expert_location import read_load
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import DBO, NONE
from moe_overlap.core.workloads import Workload, check_fits, make_batches, parse_workload
from moe_overlap.engine.args import LayoutArgs, ModelArgs, parse_modes
from moe_overlap.engine.eplb_args import EplbArgs
from moe_overlap.engine.overlap_args import OverlapArgs
from moe_overlap.planner.cluster import Cluster, load_cluster
from moe_overlap.planner.imbalance import Imbalance, placement_shape, plan_imbalance
from moe_overlap.planner.inputs import (
    ModelSpec,
    PlanLayout,
    load_model_spec,
    make_layout,
    with_precision,
)
from moe_overlap.planner.plan import Planner
from moe_overlap.planner.report import (
    compare_table,
    plan_json,
    plan_table,
    read_bench,
    recommend,
    sweep_table,
)
from moe_overlap.planner.reproduce import reproduce, reproduce_table
from moe_overlap.planner.speculative import (
    plan_speculation,
    speculation_inputs,
    speculation_table,
    speculation_verdict,
    speculative_workload,
)
from moe_overlap.planner.sweep import crossover, decode_sweep
from moe_overlap.tools.command_flags import PlanFlags
from moe_overlap.tools.flags import add_fields
from moe_overlap.tools.measure_this import calibrate_this
from moe_overlap.tools.trace import write_outputs


def plan_layout(args: argparse.Namespace, cfg: ModelConfig) -> PlanLayout:
    """The layout the flags name, with the engine's defaults: --tp 1 with --ep N is pure EP,
    and --dp 1 leaves the groups to --tp."""
    tp, dp = (None if args.tp == 1 else args.tp), (None if args.dp == 1 else args.dp)
    redundant = args.ep_num_redundant_experts  # EPLB's slots: --ep divides E + R
    return make_layout(tp, dp, args.ep, args.enable_dp_attention, cfg, redundant)


def plan_cluster(
    args: argparse.Namespace, spec: ModelSpec, layout: PlanLayout
) -> tuple[Cluster, Imbalance | None]:
    """The cluster ``--cluster`` names (``this``: calibrated here), with the experts'
    imbalance the flags give, checked to hold the layout."""
    if args.cluster == "this":  # measured as the engine runs the checkpoint
        if args.repeat < 1:  # before measuring: it would take no sample, then no median
            raise ConfigError(f"--repeat={args.repeat} must be >= 1 (forwards per shape)")
        started = time.perf_counter()
        cluster = calibrate_this(spec, layout, args.link, args.repeat, args.calibration)
        print(f"calibrated this machine in {time.perf_counter() - started:.1f} s")
    else:
        cluster = load_cluster(args.cluster)
    imbalance = expert_imbalance(args, spec.cfg, layout.ep, cluster.gpus_per_node)
    if imbalance is not None:  # every MoE layer timed at its busiest rank
        cluster = dataclasses.replace(cluster, expert_imbalance=imbalance.factor)
    if layout.world > cluster.world:
        raise ConfigError(
            f"{layout.world} GPUs asked for, cluster {cluster.name} has {cluster.world}"
        )
    return cluster, imbalance


def compared_bench(path: str | None, workload: Workload, layout: PlanLayout) -> dict | None:
    """``--compare-bench``'s file, read before planning: of this workload and layout."""
    return read_bench(path, workload.spec, workload.tokens, layout.ep) if path else None


def one_gpu_note(cluster: Cluster) -> str:
    return (
        f"note: planned on 1 GPU of {cluster.name}'s {cluster.world}: nothing crosses GPUs, so "
        f"there is no communication to overlap; give --ep {cluster.world} (or --tp) to plan "
        "the cluster"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    if args.reproduce:
        return cmd_reproduce()
    if not args.hf_config or not args.cluster:
        raise ConfigError("plan needs --hf-config JSON and --cluster NAME|JSON (or --reproduce)")
    spec = load_model_spec(args.hf_config)
    layout = plan_layout(args, spec.cfg)
    names = parse_modes(args.modes)
    base = OverlapConfig(tbo_decode_order=args.tbo_decode_order)
    configs = {m: mode_config(m, base) for m in names}
    if NONE.name not in configs:
        raise ConfigError(f"--modes {args.modes!r} must include none, the baseline")
    _check_sweep(args.decode_sweep, spec.cfg)
    speculation = speculation_inputs(
        args.speculative_num_draft_tokens, args.accept_length, args.speculative_drafter
    )
    workload_spec, workload_note = speculative_workload(args.workload, speculation is not None)
    workload = parse_workload(workload_spec, layout.dp_groups, args.seed)
    check_fits(f"--workload {workload_spec}", workload.longest, spec.cfg)
    measured = compared_bench(args.compare_bench, workload, layout)
    cluster, imbalance = plan_cluster(args, spec, layout)
    started = time.perf_counter()  # the planning alone, after any calibration
    spec = with_precision(spec, args.quantization, args.moe_dispatch_dtype)
    group_batches = make_batches(workload, spec.cfg.vocab_size, args.seed)
    batches = [group_batches[layout.group_of(r)] for r in range(layout.world)]
    planner = Planner(spec, cluster, layout)
    record = bool(args.trace or args.plot)
    plans = {m: planner.plan(m, cfg, batches, record) for m, cfg in configs.items()}
    elapsed = time.perf_counter() - started
    console = Console(width=max(Console().width, 120))
    for note in (*spec.notes, *([workload_note] if workload_note else [])):
        console.print(f"note: {note}")
    if layout.world == 1 < cluster.world:
        console.print(one_gpu_note(cluster))
    unit = "rank" if cluster.name == "this" else "GPU"  # this machine's: CPU ranks
    gpus = f"1 {unit}" if layout.world == 1 else f"{layout.world} {unit}s"
    title = (
        f"{spec.name} on {cluster.name} ({gpus}, EP {layout.ep}, attention TP "
        f"{layout.attn_tp}), workload {workload.spec} ({workload.tokens} tokens per forward), "
        f"{spec.precision(cluster.activation_bytes)}"
    )
    if imbalance is not None:  # every MoE layer at its busiest rank
        console.print(f"expert balancedness {imbalance_text(imbalance)}")
    console.print(plan_table(plans, workload.tokens, title))
    best, sentence = recommend(plans, configs)
    console.print(f"recommended: {sentence}")
    console.print(f"planned in {elapsed:.2f} s")
    out = {"model": args.hf_config, "cluster": cluster.to_json(), "ep": layout.ep}
    out |= plan_json(plans, workload.tokens, workload.spec) | {"recommended": best}
    recording = {m: p.spans for m, p in plans.items() if p.spans is not None}
    write_outputs(console, recording, args, out)
    if measured is not None:
        console.print(compare_table(plans, measured, workload.spec))
    if args.decode_sweep is not None:
        print_decode_sweep(console, planner, configs, layout, spec, args)
    if speculation is not None:
        specs = plan_speculation(planner, configs, batches, layout, speculation)
        print_speculation(console, specs, speculation, title)
    return 0


def print_speculation(console, specs, speculation, title: str) -> None:
    console.print(speculation_table(specs, speculation, f"speculative decoding: {title}"))
    for line in speculation_verdict(specs):
        console.print(line, highlight=False)


def expert_imbalance(
    args: argparse.Namespace, cfg: ModelConfig, ep: int, gpus_per_node: int
) -> Imbalance | None:
    """``--balancedness`` or ``--expert-distribution``, placed by EPLB where asked."""
    redundant, eplb = args.ep_num_redundant_experts, args.enable_eplb
    given = args.balancedness is not None, args.expert_distribution is not None
    if all(given):
        raise ConfigError("give --balancedness or --expert-distribution, not both")
    if not any(given):
        if eplb or redundant:
            raise ConfigError(
                "--enable-eplb and --ep-num-redundant-experts in a plan need the routing to "
                "balance: --balancedness B or --expert-distribution FILE"
            )
        return None
    load = read_load(args.expert_distribution) if given[1] else None
    shape = placement_shape(cfg, ep, redundant, gpus_per_node)
    algorithm = cast(Algorithm, args.eplb_algorithm)
    return plan_imbalance(shape, args.balancedness, load, eplb or redundant > 0, algorithm)


def imbalance_text(imbalance: Imbalance) -> str:
    if not imbalance.eplb:
        return f"{imbalance.planned:.3f}"
    return f"{imbalance.before:.3f} -> {imbalance.planned:.3f} after EPLB"


def _check_sweep(ctx: int | None, cfg: ModelConfig) -> None:
    if ctx is None:
        return
    if ctx < 1:
        raise ConfigError(f"--decode-sweep={ctx} must be >= 1 (tokens of context)")
    check_fits(f"--decode-sweep {ctx}", ctx + 1, cfg)  # its decodes: one token past it


def cmd_reproduce() -> int:
    """The published GPU cases (``planner/reproduce.py``), each planned and compared."""

    def batches_for(spec: str, layout) -> list:
        workload = parse_workload(spec, layout.dp_groups, 0)
        group = make_batches(workload, 1, 0)  # token ids do not change a plan
        return [group[layout.group_of(r)] for r in range(layout.world)]

    outcomes, elapsed = reproduce(batches_for, mode_config)
    console = Console(width=max(Console().width, 160))
    console.print(reproduce_table(outcomes))
    console.print(f"planned {len(outcomes)} published cases in {elapsed:.2f} s")
    return 0


def print_decode_sweep(console, planner, configs, layout, spec, args) -> None:
    """Decode batch sizes 1..1024 per DP group at ``--decode-sweep`` tokens of context: each
    mode's speed-up, and the batch size from which it beats none."""
    ctx = args.decode_sweep

    def batches_for(bs: int) -> list:
        workload = parse_workload(f"decode:{bs}:{ctx}", layout.dp_groups, args.seed)
        group = make_batches(workload, spec.cfg.vocab_size, args.seed)
        return [group[layout.group_of(r)] for r in range(layout.world)]

    points = decode_sweep(planner, configs, batches_for)
    console.print(sweep_table(points, ctx, f"decode sweep on {planner.cluster.name}"))
    for mode in (m for m in configs if m != NONE.name):
        bs = crossover(planner, configs, batches_for, points, mode)
        if bs is None:
            console.print(f"{mode}: never beats none up to {points[-1].batch_size} per rank")
            continue
        flag = " (--dbo-decode-token-threshold {bs})" if configs[mode].mode == DBO.name else ""
        console.print(f"{mode} beats none from {bs} decode tokens per rank{flag.format(bs=bs)}")


def add_plan_command(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict each overlap mode on a cluster without running it",
        description="Run the engine's own overlap schedules over simulated operations timed "
        "from FLOPs and bytes on a cluster, and print each mode's predicted time, speed-up, "
        "limit max(T_comp, T_comm), bottleneck and the flags to use. Needs --hf-config and "
        "--cluster, or --reproduce alone.",
    )
    add_fields(plan, ModelArgs, only=("hf_config", "seed"))
    add_fields(plan, LayoutArgs, only=("tp", "dp", "ep", "enable_dp_attention", "link"))
    add_fields(plan, OverlapArgs, only=("moe_dispatch_dtype", "tbo_decode_order"))
    add_fields(plan, PlanFlags)
    add_fields(plan, EplbArgs, only=("enable_eplb", "ep_num_redundant_experts", "eplb_algorithm"))
    plan.set_defaults(func=cmd_plan)
