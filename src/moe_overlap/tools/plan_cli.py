"""``moe-overlap plan``: predict every overlap mode on a cluster, from a config.json alone.

``--cluster this`` first measures this machine (the engine's ranks over ``--link``: no-overlap
forwards of prefill and decode shapes, and a tiny decode with and without two micro-batches;
see ``planner/calibration.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from statistics import median

from rich.console import Console

from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.llm import LLM
from moe_overlap.planner.calibration import fit_cluster
from moe_overlap.planner.cluster import Cluster, load_cluster, presets
from moe_overlap.planner.inputs import ModelSpec, PlanLayout, load_model_spec, make_layout
from moe_overlap.planner.measurements import (
    PAIRS,
    TWO_PASSES,
    PassSample,
    Sample,
    calibration_batches,
    decode_batch,
    measurements_from_json,
    measurements_json,
    rank_batches,
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
from moe_overlap.planner.sweep import crossover, decode_sweep
from moe_overlap.tools.bench import DEFAULT_MODES, make_batches, mode_config
from moe_overlap.tools.cli_args import add_link_arg
from moe_overlap.tools.trace import write_outputs
from moe_overlap.tools.workloads import parse_workload

_MB = re.compile(r"(\d+(?:\.\d+)?) MB")
_OUT_IN = re.compile(r"(\d+(?:\.\d+)?) out, (\d+(?:\.\d+)?) in\)")
NONE = mode_config("none")


def _timed(executor, batches, cfg, record: bool = False) -> float:
    start = time.perf_counter()
    executor.run(batches, cfg, record=record)
    return time.perf_counter() - start


def _dispatch_bytes(spans) -> tuple:
    """Per dispatch (a MoE layer's), per rank: the bytes it sent off the rank and received,
    read from the dispatches' labels."""
    found = [
        [_OUT_IN.search(s.name) for s in rank_spans if s.name.startswith("dispatch")]
        for rank_spans in spans
    ]
    if not all(found) or not all(m for rank in found for m in rank):
        return ()  # no dispatch, or labels without bytes: nothing to learn
    return tuple(
        tuple((float(f[1]) * 1e6, float(f[2]) * 1e6) for f in layer)
        for layer in zip(*found, strict=True)
    )


def _rounds(executor, batches, rounds: int, pairs=()) -> tuple[list, list]:
    """``rounds`` rounds over every shape (its ranks' batches: no overlap, recorded) and every
    pair (``(mode, batches)``: no overlap, then two micro-batches, twice) in turn, so that a burst of load on
    this shared machine hits every shape alike. Per batch a ``Sample`` (median wall and
    all-to-all time, its all-to-alls' bytes and seconds); per pair a ``PassSample``: the median
    wall without overlap, and with two micro-batches that plus the median of the differences
    between neighbouring runs (a burst of load lifts both runs of a difference alike)."""
    walls, comms, transfers = ([[] for _ in batches] for _ in range(3))
    routed = [() for _ in batches]  # the same tokens every round: the same routing
    none, extra = [[] for _ in pairs], [[] for _ in pairs]
    for _ in range(rounds):
        for i, batch in enumerate(batches):
            walls[i].append(_timed(executor, batch, NONE, record=True))
            spans = executor.last_spans
            comms[i].append(
                max(sum(s.end - s.start for s in r if s.track == "comm") for r in spans)
            )
            for s in spans[0]:
                found = _MB.search(s.name) if s.track == "comm" else None
                if found:
                    transfers[i].append((float(found[1]) * 1e6, s.end - s.start))
            routed[i] = _dispatch_bytes(spans)
        for i, (mode, pair) in enumerate(pairs):
            for _ in range(2):
                none[i].append(_timed(executor, pair, NONE))
                extra[i].append(_timed(executor, pair, TWO_PASSES[mode]) - none[i][-1])
    samples = [
        Sample(b[0], median(w), median(c), tuple(t), r)
        for b, w, c, t, r in zip(batches, walls, comms, transfers, routed, strict=True)
    ]
    passes = [
        PassSample(pair[0], median(n), median(n) + median(e), mode)
        for (mode, pair), n, e in zip(pairs, none, extra, strict=True)
    ]
    return samples, passes


def calibrate_this(
    spec: ModelSpec, layout: PlanLayout, link: str, repeat: int, saved: str | None = None
) -> Cluster:
    """This machine's ranks and link as a Cluster (a run of a few seconds per shape). With
    ``saved``: the measurements in that file if it exists, else measured and written there."""
    about = {"config": spec.name, "ep": layout.ep, "world": layout.world, "link": link}
    if saved and Path(saved).is_file():
        try:
            raw = json.loads(Path(saved).read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"--calibration {saved}: not JSON ({exc}); remove it to measure again"
            ) from None
        samples, passes = measurements_from_json(raw, spec.cfg.vocab_size, about)
        return fit_cluster(spec, layout, samples, passes)
    samples, passes = measure_this(spec, layout, link, repeat)
    if saved:
        Path(saved).parent.mkdir(parents=True, exist_ok=True)
        Path(saved).write_text(json.dumps(measurements_json(samples, passes, about)))
    return fit_cluster(spec, layout, samples, passes)


def measure_this(
    spec: ModelSpec, layout: PlanLayout, link: str, repeat: int
) -> tuple[list[Sample], list[PassSample]]:
    """The calibration's measured forwards (``planner/calibration.py`` says which)."""
    batches = calibration_batches(spec.cfg.vocab_size)
    with LLM(
        config=spec.cfg,
        ep=layout.ep,
        link=link,
        max_num_seqs=max(b.num_seqs for b in batches),
        max_model_len=max(max(b.prefix_lens) + max(b.extend_lens) for b in batches) + 1,
    ) as llm:
        ex = llm.executor

        def on_ranks(batch):
            return rank_batches(batch, layout.world, spec.cfg.vocab_size)

        pairs = [(m, on_ranks(decode_batch(*shape))) for m, shape in PAIRS]
        # decode first: a long prefill widens the cache and slows decode reads
        decode = [on_ranks(b) for b in batches if all(b.is_decode)]
        prefill = [on_ranks(b) for b in batches if not all(b.is_decode)]
        for mode, pair in pairs:  # warm every path once
            ex.run(pair, TWO_PASSES[mode])
        for ranks in decode:
            ex.run(ranks, NONE)
        # decode steps and pairs are short: more rounds
        samples, passes = _rounds(ex, decode, 3 * (repeat + 1), pairs)
        for ranks in prefill:
            ex.run(ranks, NONE)
        samples += _rounds(ex, prefill, repeat)[0]
    return samples, passes


def cmd_plan(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    spec = load_model_spec(args.config)
    layout = make_layout(args.tp, args.dp, args.ep, args.enable_dp_attention)
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    configs = {m: mode_config(m) for m in names}
    if "none" not in configs:
        raise ConfigError(f"--modes {args.modes!r} must include none, the baseline")
    workload = parse_workload(args.workload, layout.dp_groups, args.seed)
    measured = read_bench(args.compare_bench, workload.spec) if args.compare_bench else None
    if args.cluster == "this":
        cluster = calibrate_this(spec, layout, args.link, args.repeat, args.calibration)
        print(f"calibrated this machine in {time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
    else:
        cluster = load_cluster(args.cluster)
    if layout.world > cluster.world:
        raise ConfigError(
            f"{layout.world} GPUs asked for, cluster {cluster.name} has {cluster.world}"
        )
    group_batches = make_batches(workload, spec.cfg.vocab_size, args.seed)
    batches = [group_batches[layout.group_of(r)] for r in range(layout.world)]
    planner = Planner(spec, cluster, layout)
    record = bool(args.trace or args.plot)
    plans = {m: planner.plan(m, cfg, batches, record) for m, cfg in configs.items()}
    elapsed = time.perf_counter() - started
    console = Console(width=max(Console().width, 120))
    for note in spec.notes:
        console.print(f"note: {note}")
    title = (
        f"{spec.name} on {cluster.name} ({layout.world} GPUs, EP {layout.ep}, attention TP "
        f"{layout.attn_tp}), workload {workload.spec} ({workload.tokens} tokens per forward)"
    )
    console.print(plan_table(plans, workload.tokens, title))
    best, sentence = recommend(plans, configs)
    console.print(f"recommended: {sentence}")
    console.print(f"planned in {elapsed:.2f} s")
    out = {"model": args.config, "cluster": cluster.to_json(), "ep": layout.ep}
    out |= plan_json(plans, workload.tokens, workload.spec) | {"recommended": best}
    recording = {m: p.spans for m, p in plans.items() if p.spans is not None}
    write_outputs(console, recording, args, out)
    if measured is not None:
        console.print(compare_table(plans, measured, workload.spec))
    if args.decode_sweep:
        print_decode_sweep(console, planner, configs, layout, spec, args)
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
    for mode in (m for m in configs if m != "none"):
        bs = crossover(planner, configs, batches_for, points, mode)
        if bs is None:
            console.print(f"{mode}: never beats none up to {points[-1].batch_size} per rank")
            continue
        flag = " (--dbo-decode-token-threshold {bs})" if configs[mode].mode == "dbo" else ""
        console.print(f"{mode} beats none from {bs} decode tokens per rank{flag.format(bs=bs)}")


def add_plan_command(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="predict each overlap mode on a cluster without running it",
        description="Run the engine's own overlap schedules over simulated operations timed "
        "from FLOPs and bytes on a cluster, and print each mode's predicted time, speed-up, "
        "limit max(T_comp, T_comm), bottleneck and the flags to use.",
    )
    plan.add_argument("--config", required=True, metavar="JSON", help="a Hugging Face config.json")
    plan.add_argument(
        "--cluster",
        required=True,
        metavar="NAME|JSON",
        help=f"a preset ({', '.join(presets())}), a cluster JSON file, or this (this machine, "
        "measured by a short run over --link)",
    )
    plan.add_argument("--tp", type=int, default=None, help="GPUs (SGLang's tp); default --ep")
    plan.add_argument("--dp", type=int, default=None, help="attention DP groups")
    plan.add_argument("--ep", type=int, default=2, help="expert-parallel size (default 2)")
    plan.add_argument(
        "--enable-dp-attention", action="store_true", help="each DP group has its own requests"
    )
    add_link_arg(plan)
    plan.add_argument(
        "--workload",
        default="uniform:30-3072",
        metavar="SPEC",
        help="the bench's grammar: single-long[:N], uniform:A-B[:T], decode:BS[:CTX], file:PATH "
        "(per DP group)",
    )
    plan.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="the bench's modes, comma-separated (default: %(default)s)",
    )
    plan.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    plan.add_argument(
        "--repeat", type=int, default=3, help="--cluster this: forwards per calibration shape"
    )
    plan.add_argument(
        "--calibration",
        metavar="PATH",
        help="--cluster this: reuse the measurements in PATH if it exists, else measure and "
        "save them there",
    )
    plan.add_argument(
        "--compare-bench",
        metavar="BENCH_JSON",
        help="a `moe-overlap bench --json` file of the same workload: print the plan next to "
        "it, mode by mode, with the error",
    )
    plan.add_argument(
        "--decode-sweep",
        type=int,
        metavar="CTX",
        help="also sweep decode batch sizes 1..1024 per rank at CTX tokens of context and print "
        "where each mode starts to beat none (DBO's --dbo-decode-token-threshold)",
    )
    plan.add_argument("--json", metavar="PATH", help="write the plan in the bench's JSON shape")
    plan.add_argument("--trace", metavar="PATH", help="write the predicted timelines as a trace")
    plan.add_argument("--plot", metavar="PATH", help="draw the predicted timelines of rank 0")
    plan.set_defaults(func=cmd_plan)
