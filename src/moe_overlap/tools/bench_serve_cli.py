"""``moe-overlap bench-serve``: the online benchmark, against servers it starts (one per overlap
mode) or against any OpenAI-compatible server already running (``--base-url``)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import SERVE_LABELS
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.workloads import check_fits
from moe_overlap.engine.args import parse_modes
from moe_overlap.engine.engine_args import without_overlap_knobs
from moe_overlap.engine.llm import LLM
from moe_overlap.server.settings import ServerSettings
from moe_overlap.tools.bench_datasets import (
    BenchRequest,
    check_dataset_flags,
    prefix_repetition_requests,
    random_requests,
    workload_requests,
)
from moe_overlap.tools.bench_serve import Target, cache_hit_rate, free_port, run_load
from moe_overlap.tools.bench_serve_report import (
    NO_PREFIX_CACHE,
    NO_SPECULATION,
    load_table,
    prefix_caching_note,
    speculative_note,
)
from moe_overlap.tools.cli_args import (
    add_engine_args,
    add_model_args,
    engine_args,
    engine_kwargs,
    mode_configs,
)
from moe_overlap.tools.command_flags import LOAD_DEFAULTS, LoadFlags
from moe_overlap.tools.flags import add_fields
from moe_overlap.tools.serving_metrics import parse_metrics, parse_percentiles, result_block


def add_bench_serve_command(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench-serve",
        help="online benchmark: Poisson arrivals against a server, per overlap mode",
        description="Send a Poisson stream of streamed completions (random token ids, their "
        "lengths from --dataset-name: our --workload or vLLM's random and prefix_repetition) at "
        "each rate and report TTFT, TPOT, ITL and end-to-end "
        "latency and throughput, with vLLM's result block and JSON keys. Without --base-url, "
        "for each of --modes start our server with the engine flags and that overlap mode; "
        "with --base-url, measure the OpenAI-compatible server already running there (ours, "
        "vLLM's or SGLang's).",
    )
    add_model_args(bench)  # not needed with --base-url
    add_engine_args(bench)
    add_fields(bench, LoadFlags)
    bench.set_defaults(func=cmd_bench_serve)


_AT_LEAST_ONE = (
    "num_requests",
    "output_len",
    "max_concurrency",
    "vocab_size",
    "random_input_len",
    "random_output_len",
    "prefix_repetition_prefix_len",
    "prefix_repetition_suffix_len",
    "prefix_repetition_num_prefixes",
    "prefix_repetition_output_len",
)


def _check(args: argparse.Namespace) -> tuple[list[str], list[float], tuple]:
    rates = _rates(args.rates)
    for flag, what in (("prefix_caching", "the cache"), ("speculative", "speculation")):
        if args.base_url and getattr(args, f"compare_{flag}"):
            raise ConfigError(
                f"--compare-{flag.replace('_', '-')} starts our servers with {what} on and "
                "off; a server at --base-url runs its own: drop one of them"
            )
    if args.compare_prefix_caching and args.compare_speculative:
        raise ConfigError(
            "--compare-prefix-caching and --compare-speculative each run every mode twice; "
            "give one of them"
        )
    for name in _AT_LEAST_ONE:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.random_prefix_len < 0:
        raise ConfigError(f"--random-prefix-len={args.random_prefix_len} must be >= 0")
    if not 0 <= args.random_range_ratio < 1:
        raise ConfigError(
            f"--random-range-ratio={args.random_range_ratio} must be in [0, 1): lengths are "
            "drawn from mean x [1 - R, 1 + R]"
        )
    check_dataset_flags(args, LOAD_DEFAULTS)  # after the values' own checks
    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration={args.duration} must be a positive number of seconds")
    if args.base_url and args.modes:
        raise ConfigError(
            "--modes picks the overlap of servers bench-serve starts; a server at "
            "--base-url runs its own: drop one of them"
        )
    try:
        metrics = (
            parse_metrics(args.percentile_metrics),
            parse_percentiles(args.metric_percentiles),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    modes = list(parse_modes(args.modes) if args.modes else SERVE_LABELS)
    return (["external"] if args.base_url else modes), rates, metrics


def cmd_bench_serve(args: argparse.Namespace) -> int:
    modes, rates, metrics = _check(args)
    overlaps = {} if args.base_url else mode_configs(args, modes)  # bad names fail now
    cfg = _model_config(args)
    prompts = bench_requests(args, cfg.vocab_size if cfg else args.vocab_size)
    if cfg is not None:
        longest = max(len(r.prompt) + r.output_len for r in prompts)
        check_fits(f"--dataset-name {_dataset(args)}", longest, cfg, args.max_model_len)
    console, results = Console(width=max(Console().width, 132)), []  # the table is wide
    for mode, (suffix, variant) in ((m, v) for m in modes for v in _variants(args)):
        label = mode + suffix
        with _target(args, cfg, overlaps.get(mode), variant) as target:
            for rate in rates:
                count = (
                    round(rate * args.duration)
                    if args.duration and rate != float("inf")
                    else len(prompts)
                )
                sent = [prompts[i % len(prompts)] for i in range(max(count, 1))]
                console.print(f"{label}: {len(sent)} requests at {rate:g}/s ...")
                result = run_load(
                    target,
                    sent,
                    rate,
                    args.seed,
                    label,
                    args.max_concurrency,
                    metrics,
                    progress=console.is_terminal,
                )
                console.print(result_block(result.summary, *metrics), highlight=False)
                results.append(result)
            hit_rate = cache_hit_rate(target) if not args.base_url else None
            if hit_rate is not None:
                console.print(f"{label}: prefix cache hit rate {hit_rate:.1%} of prompt tokens")
    console.print(load_table(results, _title(args)))
    if args.compare_prefix_caching:
        console.print(prefix_caching_note(results), highlight=False)
    if args.compare_speculative:
        console.print(speculative_note(results), highlight=False)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": (args.model or args.hf_config),
            "base_url": args.base_url,
            "link": args.link,
        }
        workload = args.workload if args.dataset_name == "workload" else None  # else unused
        payload |= {"workload": workload, "dataset": _dataset(args)}
        payload["results"] = [r.to_json() for r in results]
        Path(args.json).write_text(json.dumps(payload, indent=2))
        console.print(f"results: {args.json}")
    return 1 if any(r.errors for r in results) else 0


def bench_requests(args: argparse.Namespace, vocab: int) -> list[BenchRequest]:
    """The requests of --dataset-name, --num-requests of them."""
    count, seed = args.num_requests, args.seed
    if args.dataset_name == "random":
        return random_requests(
            count,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            vocab,
            seed,
        )
    if args.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(
            count,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
            vocab,
            seed,
        )
    return workload_requests(args.workload, count, args.output_len, vocab, seed)


def _dataset(args: argparse.Namespace) -> str:
    """The dataset and its lengths, as the title and errors name them."""
    if args.dataset_name == "random":
        return (
            f"random (--random-input-len {args.random_input_len}, --random-output-len "
            f"{args.random_output_len}, ratio {args.random_range_ratio:g}, prefix "
            f"{args.random_prefix_len})"
        )
    if args.dataset_name == "prefix_repetition":
        return (
            f"prefix_repetition ({args.prefix_repetition_num_prefixes} prefixes of "
            f"{args.prefix_repetition_prefix_len} + {args.prefix_repetition_suffix_len} "
            f"tokens, {args.prefix_repetition_output_len} out)"
        )
    return f"workload {args.workload} with --output-len {args.output_len}"


def _model_config(args: argparse.Namespace) -> ModelConfig | None:
    if args.model or args.hf_config:
        return ModelConfig.from_hf(args.model or args.hf_config)
    if not args.base_url:
        raise ConfigError("bench-serve needs --model or --hf-config for the server it starts")
    if args.vocab_size is None:
        raise ConfigError(
            "with --base-url, give --vocab-size (or --model/--hf-config) so the "
            "random prompts hold only token ids the served model knows"
        )
    return None


def _variants(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """Each server a mode runs with: its label's suffix and the engine settings it changes
    (--compare-*: with the feature, then without it)."""
    if args.compare_prefix_caching:
        return [
            ("", {"enable_prefix_caching": True}),
            (NO_PREFIX_CACHE, {"enable_prefix_caching": False}),
        ]
    if args.compare_speculative:
        given = args.speculative_algorithm or args.speculative_config
        off = dict.fromkeys(("speculative_config", "speculative_num_draft_tokens"))
        return [
            ("", {} if given else {"speculative_algorithm": "NGRAM"}),
            (NO_SPECULATION, {**off, "speculative_algorithm": None}),
        ]
    return [("", {})]


@contextmanager
def _target(
    args: argparse.Namespace, cfg: ModelConfig | None, overlap, variant: dict
) -> Iterator[Target]:
    """The server at --base-url, or ours with ``overlap`` and the ``variant``'s settings,
    running until the block ends."""
    if args.base_url:
        yield Target(args.base_url, args.api_key, args.served_model_name, local=False)
        return
    kwargs = {**without_overlap_knobs(engine_kwargs(args)), "overlap": overlap, **variant}
    from moe_overlap.server.run import Server  # FastAPI loads only when we serve

    llm = LLM(**kwargs)
    port = free_port()
    server = Server(llm, ServerSettings("bench"), port=port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server bench-serve started did not come up")
            time.sleep(0.05)
        yield Target(f"http://127.0.0.1:{port}", None, "bench")
    finally:
        server.stop()
        thread.join()


def _title(args: argparse.Namespace) -> str:
    load = f"{args.duration:g} s" if args.duration else f"{args.num_requests} requests"
    load += f" per rate, {_dataset(args)}"
    if args.base_url:
        return f"{args.base_url}, {load}"
    layout = engine_args(args).parallel_config().describe()
    name = Path(args.model or args.hf_config).stem
    return f"{name}, {layout}, --link {args.link}, {load}"


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]  # an empty item is refused, not dropped
    except ValueError:
        raise ConfigError(f"--rates {text!r} must be comma-separated numbers, e.g. 1,4") from None
    if not rates or not all(r > 0 for r in rates):
        raise ConfigError(f"--rates {text!r}: every rate must be a positive number")
    return rates
