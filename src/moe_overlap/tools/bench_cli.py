"""The ``bench`` and ``probe-link`` commands: measure overlap and the link itself."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from statistics import median

from rich.console import Console

from moe_overlap.core.a2a_mode import A2AMode, DispatchDtype, step_a2a_mode
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.hf_config import read_json
from moe_overlap.core.kv_budget import available_ram
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.mode_labels import DEFAULT_LABELS
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.repo_files import REPO_ROOT
from moe_overlap.core.workloads import Workload, check_fits, make_batches, parse_workload
from moe_overlap.distributed.link import parse_link
from moe_overlap.engine.args import BenchArgs, LayoutArgs, ModelArgs, parse_modes
from moe_overlap.engine.engine_args import CapacityArgs, EngineArgs, without_overlap_knobs
from moe_overlap.engine.eplb_args import EplbArgs
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.overlap_args import OverlapArgs
from moe_overlap.model.fp8_resident import expert_kernels, fp8_path
from moe_overlap.model.quant_config import quant_config_of
from moe_overlap.tools.bench import Arm, BenchReport, run_arms
from moe_overlap.tools.bench_bounds import zero_host_bounds
from moe_overlap.tools.bench_eplb import bench_eplb
from moe_overlap.tools.cli_args import (
    add_model_args,
    bench_engine_kwargs,
    engine_args,
    engine_kwargs,
    mode_configs,
    model_path,
)
from moe_overlap.tools.command_flags import BenchFlags, ProbeFlags
from moe_overlap.tools.flags import add_fields
from moe_overlap.tools.report import bench_table, dtype_table
from moe_overlap.tools.trace import write_outputs

PROBE_CONFIG = "configs/qwen3-moe-tiny.json"  # the repository's, wherever the command runs
PROBE_LAYOUT = (
    "ep",
    "timeout",
    "link",
    "device",
    "dtype",
    "cuda_graph_max_bs",
    "disable_cuda_graph",
)
BENCH_MEMORY = ("page_size", "mem_fraction_static", "max_total_tokens", "kv_cache_memory")


def cmd_probe_link(args: argparse.Namespace) -> int:
    if args.ep < 2:
        raise ConfigError(f"--ep={args.ep}: probing a link needs 2 or more ranks")
    if not args.mib > 0:
        raise ConfigError(f"--mib={args.mib:g} must be positive")
    if args.repeat < 1:
        raise ConfigError(f"--repeat={args.repeat} must be >= 1")
    held, free = 2 * args.ep * args.mib * 2**20, available_ram()  # every rank sends, receives
    if args.device == "cpu" and free is not None and held > free:
        raise ConfigError(
            f"--mib={args.mib:g}: {args.ep} ranks' send and receive buffers take "
            f"{held / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free; lower --mib"
        )
    spec = parse_link(args.link)
    with LLM(
        **engine_kwargs(args) | {"hf_config": args.hf_config or str(REPO_ROOT / PROBE_CONFIG)}
    ) as llm:
        per_rank = llm.executor.probe(int(args.mib * 2**20), args.repeat)
    slowest = [
        max(ts) for ts in zip(*per_rank, strict=True)
    ]  # a collective ends with its last rank
    crossing = args.mib * 2**20 * (args.ep - 1) / args.ep
    print(f"all-to-all of {args.mib:g} MiB per rank over {args.ep} ranks, link {spec.spec}:")
    print(
        f"  median {median(slowest) * 1e3:.1f} ms, min {min(slowest) * 1e3:.1f} ms, "
        f"max {max(slowest) * 1e3:.1f} ms over {args.repeat} runs"
    )
    if spec.bytes_per_s:
        ideal = crossing / spec.bytes_per_s + (spec.latency_s or 0.0)
        print(
            f"  size/rate of the {crossing / 2**20:g} MiB that leave each rank: "
            f"{ideal * 1e3:.1f} ms (measured / ideal = {median(slowest) / ideal:.2f})"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    modes = list(parse_modes(args.modes))
    if NONE.name not in modes:
        raise ConfigError(f"--modes {args.modes!r} must include none, the baseline")
    settings, peers = engine_args(args), args.emulate_peers
    par = settings.parallel_config()
    check_layout(par, emulate_peers=peers)  # the layout's own refusals, before any mode's
    configs = mode_configs(args, modes)
    given = args.modes != ",".join(DEFAULT_LABELS)
    for mode in modes:  # each mode on this layout, as the engine would check it
        try:
            check_layout(par, overlap=configs[mode], emulate_peers=peers)
        except ConfigError as exc:
            if given:
                raise ConfigError(f"--modes {mode}: {exc}") from None
            del configs[mode]  # the default list: what this layout runs, each left out named
            print(f"moe-overlap: bench: {mode} left out: {exc}", file=sys.stderr)
    modes = [m for m in modes if m in configs]
    if args.repeat < 1:
        raise ConfigError(f"--repeat={args.repeat} must be >= 1")
    cfg = ModelConfig.from_hf(model_path(args))
    workload = bench_workload(args, cfg, peers or par.attn_dp)
    batches = make_batches(workload, cfg.vocab_size, args.seed)
    a2a, cap = configs[NONE.name].a2a_mode, args.num_max_dispatch_tokens_per_rank
    step_a2a_mode(a2a, batches, cap, True, share=par.attn_tp)  # a rank sends its group's share
    console = Console(width=max(Console().width, 120))  # the tables are wide, piped too
    title = bench_title(args, par, workload)
    if args.eplb_compare is not None:  # three placements, each on its own ranks
        return bench_eplb(args, workload, modes, configs, console, title)
    reports = bench_engines(args, workload, modes, configs, cfg.vocab_size, console, title)
    payload = {"model": model_path(args), **settings.layout_kwargs(), "link": args.link}
    payload |= {"emulate_peers": peers} if peers else {}
    results = {}
    for dtype, report in reports.items():
        bounds = zero_host_bounds(report, cfg, par, peers, configs, args.seed, dtype)
        dispatch = f"--a2a-mode {a2a}, " if a2a != A2AMode.AUTO else ""
        console.print(
            bench_table(report, f"{title}, {dispatch}--moe-dispatch-dtype {dtype}", bounds)
        )
        results[dtype] = {"moe_dispatch_dtype": dtype} | report.to_json(bounds)
    if len(reports) > 1:
        console.print(dtype_table(reports, title))
    first = next(iter(reports))
    payload |= results[first] | ({"compared": results} if len(results) > 1 else {})
    holds = f"the --moe-dispatch-dtype {first} run" if len(reports) > 1 else None
    write_outputs(console, reports[first].recording, args, payload, holds)
    return 0


def dispatch_dtypes(args: argparse.Namespace) -> list[str]:
    """``--moe-dispatch-dtype``'s, then with ``--compare-dispatch-dtype`` the other one."""
    dtypes = [args.moe_dispatch_dtype]
    if args.compare_dispatch_dtype:
        dtypes += [d for d in DispatchDtype if d != args.moe_dispatch_dtype]
    return dtypes


def bench_engines(
    args: argparse.Namespace,
    workload: Workload,
    modes: list[str],
    configs: dict[str, OverlapConfig],
    vocab: int,
    console: Console,
    title: str,
) -> dict[str, BenchReport]:
    """One engine per dispatch dtype, all started at once and taking turns repetition by
    repetition (``run_arms``); each dtype's reports."""
    sized = bench_engine_kwargs(args, workload)
    with ExitStack() as stack:
        arms, llms = {}, {}
        for dtype in dispatch_dtypes(args):
            overlap = OverlapConfig(moe_dispatch_dtype=dtype)  # each mode's comes per step
            engine = without_overlap_knobs(sized) | {"overlap": overlap}
            llms[dtype] = stack.enter_context(LLM(**engine, emulate_peers=args.emulate_peers))
            overrides = {m: replace(c, moe_dispatch_dtype=dtype) for m, c in configs.items()}
            arms[dtype] = Arm(llms[dtype].executor, overrides)
        llm = next(iter(llms.values()))
        on_gpu = llm.spec.device == "cuda"
        reports = run_arms(arms, workload, args.repeat, vocab, args.seed, on_gpu=on_gpu)
        for dtype in reports:  # the tables follow, with the planner's bounds
            graphs = getattr(getattr(llms[dtype].executor, "runner", None), "graphs", None)
            if graphs is not None:  # one process on CUDA: say whether decode replayed
                console.print(
                    f"CUDA graphs ({dtype} dispatch): {len(graphs.graphs)} captured, "
                    f"{graphs.failed} failed to capture (their steps ran eagerly)"
                )
        fp8 = fp8_line(engine_args(args), llm.spec, getattr(llm.executor, "runner", None))
        if fp8 is not None:  # which path the FP8 weights ran: W8A8 or dequantized
            console.print(fp8)
    return reports


def fp8_line(settings: EngineArgs, spec: EngineSpec, runner: object = None) -> str | None:
    """Which path an FP8 checkpoint's weights ran (None: not an FP8 checkpoint); with the
    one-process ``runner``, which kernels its W8A8 expert banks ran."""
    weights = settings.model_source()[0]
    quant = quant_config_of(read_json(weights), weights) if weights else None
    path = fp8_path(quant, spec.device, spec.fp8_on_the_fly)
    model = getattr(runner, "model", None)
    kernels = None if path is None or model is None else expert_kernels(model)
    return path if kernels is None else f"{path}\n{kernels}"


def bench_workload(args: argparse.Namespace, cfg: ModelConfig, ranks: int) -> Workload:
    """Each rank's timed forward (under --emulate-peers N, rank 0's of N), checked against
    the model."""
    workload = parse_workload(args.workload, ranks, args.seed)  # a batch per DP group
    if args.emulate_peers:  # the one real rank's tokens; its peers' are alike by symmetry
        workload = Workload(workload.spec, workload.lengths[:1], workload.context)
    check_fits(f"--workload {args.workload}", workload.longest, cfg)
    if workload.decode and cfg.is_hybrid:
        raise ConfigError(
            f"--workload {args.workload}: a decode workload times the same decode step again and "
            f"again, and model_type={cfg.model_type}'s recurrent state cannot replay a step; "
            "bench its prefill (single-long, uniform)"
        )
    return workload


def bench_title(args: argparse.Namespace, par: ParallelConfig, workload: Workload) -> str:
    name, peers = Path(model_path(args)).stem, args.emulate_peers
    if peers:
        return (
            f"{name}, rank 0 of ep{peers} in one process (--emulate-peers {peers}: its peers "
            f"emulated, its logits meaningless), --link {args.link}, workload {workload.spec} "
            f"({workload.tokens} tokens per forward on this rank; each peer runs as many)"
        )
    return (
        f"{name}, {par.describe()}, --link {args.link}, "
        f"workload {workload.spec} ({workload.tokens} tokens per forward over all ranks)"
    )


def add_bench_commands(sub) -> None:
    probe = sub.add_parser(
        "probe-link",
        help="time one all-to-all over a (shaped) link",
        description="Start --ep ranks over --link and time all-to-alls of --mib MiB per rank, "
        f"next to size/rate. The ranks hold --hf-config's model (default {PROBE_CONFIG}).",
    )
    add_fields(probe, ModelArgs, only=("hf_config", "seed"))
    add_fields(probe, LayoutArgs, only=PROBE_LAYOUT)
    add_fields(probe, ProbeFlags)
    probe.set_defaults(func=cmd_probe_link)
    _add_bench_command(sub)


def _add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="time one workload through every overlap mode on the same ranks",
        description="Run a workload through each overlap mode, alternating modes across "
        "repetitions, and print tokens/s, time per forward, speed-up over none, and the share "
        "of communication each mode hid behind computation, all measured in the same run "
        "(with T_comp, T_comm and the limit max(T_comp, T_comm) from the no-overlap forwards).",
    )
    add_model_args(bench)
    add_fields(bench, LayoutArgs)  # the layout, the link and the device
    add_fields(bench, BenchFlags)
    add_fields(
        bench,
        OverlapArgs,
        only=(  # the knobs each mode runs with (the modes themselves are --modes)
            "log_overlap_decisions",
            "auto_modes",
            "moe_a2a_backend",
            "a2a_mode",
            "num_max_dispatch_tokens_per_rank",
            "moe_dispatch_dtype",
            "tbo_min_tokens",
            "tbo_mode_mismatch",
            "tbo_decode_order",
            "sbo_combine_blocks",
            "sbo_comm_sms",
            "dbo_decode_token_threshold",
            "dbo_prefill_token_threshold",
        ),
    )
    add_fields(bench, BenchArgs)
    add_fields(bench, CapacityArgs, only=BENCH_MEMORY)  # the KV pool; the rest is sized
    add_fields(bench, EplbArgs)  # redundant experts, their placement, and --expert-skew
    bench.set_defaults(func=cmd_bench)
