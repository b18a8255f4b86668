"""``moe-overlap serve``: the engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.llm import LLM
from moe_overlap.runtime.torchrun import launched_by_torchrun
from moe_overlap.server.guards import ServerSettings
from moe_overlap.server.run import Server
from moe_overlap.tools.bench import mode_config
from moe_overlap.tools.bench_serve import (
    LoadResult,
    free_port,
    make_prompts,
    prompt_lengths,
    run_load,
)
from moe_overlap.tools.cli_args import (
    add_engine_args,
    add_model_args,
    build_llm,
    engine_kwargs,
)
from moe_overlap.tools.layout_args import layout_kwargs


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streamed or whole), "
        "/v1/models and /health. Requests that arrive while others run join the batch at "
        "the next step. Ctrl-C or SIGTERM stops the server and every rank.",
    )
    add_model_args(serve)
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser(
        "bench-serve",
        help="online benchmark: Poisson arrivals against the server, per overlap mode",
        description="For each overlap mode, start the server, send a Poisson stream of "
        "streamed completions at each rate (prompt lengths from --workload, random token "
        "ids), and report time to first token and inter-token latency (p50/p99) and "
        "throughput. The engine flags apply to every mode; --modes picks the overlap scheme.",
    )
    add_model_args(bench)
    add_engine_args(bench)
    bench.add_argument(
        "--modes",
        default="none,tbo+two-chunk,dbo",
        help="comma-separated overlap modes, as for bench (default %(default)s)",
    )
    bench.add_argument(
        "--rates", default="1,4", help="requests per second, comma-separated (default 1,4)"
    )
    bench.add_argument(
        "--workload",
        default="uniform:30-3072",
        help="prompt lengths, in the bench's grammar (default %(default)s)",
    )
    bench.add_argument("--num-requests", type=int, default=32, help="per rate (default 32)")
    bench.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="soak: hold each rate for about S seconds (rate x S requests, prompts reused) "
        "instead of --num-requests; compare errors and memory before and after",
    )
    bench.add_argument("--output-len", type=int, default=32, help="tokens per answer (default 32)")
    bench.add_argument("--json", metavar="PATH", help="also write the results here")
    bench.set_defaults(func=cmd_bench_serve)


SETTING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
# the server's bounds: flag -> (ServerSettings field, type, help); defaults come from the field
LIMIT_FLAGS = {
    "--max-stop-sequences": ("max_stop_sequences", int, "most stop strings in a request"),
    "--max-stop-chars": ("max_stop_chars", int, "longest stop string, in characters"),
    "--header-timeout": ("header_timeout_s", float, "seconds for a request's headers to arrive"),
    "--body-timeout": ("body_timeout_s", float, "seconds for a request's body (408 after)"),
    "--max-connections": ("max_connections", int, "open connections at once (503 beyond)"),
    "--max-buffered-bytes": ("max_buffered_bytes", int, "request bytes being read at once (503)"),
    "--shutdown-timeout": (
        "shutdown_timeout_s",
        float,
        "seconds in-flight requests may finish on "
        "SIGTERM/SIGINT before they are ended with an error",
    ),
}


def add_server_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to "
        "the network, so set --api-key too)",
    )
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model's id in the API (default: the model directory's or config's name)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=SETTING_DEFAULTS["max_request_bytes"],
        help="largest request body accepted; larger ones get a 413 (default %(default)s)",
    )
    s.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt accepted, in tokens; longer ones get a 400 (default: the "
        "model's context less one)",
    )
    for flag, (field, kind, text) in LIMIT_FLAGS.items():
        s.add_argument(
            flag, type=kind, default=SETTING_DEFAULTS[field], help=f"{text} (default %(default)s)"
        )
    s.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (default warning; info logs every request)",
    )


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port={args.port} must be in 0..65535")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes={args.max_request_bytes} must be >= 1")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens={args.max_prompt_tokens} must be >= 1")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key must not be empty")
    limits = {
        field: getattr(args, flag[2:].replace("-", "_"))
        for flag, (field, _, _) in LIMIT_FLAGS.items()
    }
    for flag, (field, _, _) in LIMIT_FLAGS.items():
        if not limits[field] > 0:
            raise ConfigError(f"{flag}={limits[field]} must be > 0")
    source = Path(args.model).resolve().name if args.model else Path(args.config).stem
    name = args.served_model_name or source
    return ServerSettings(
        name, args.api_key, args.max_request_bytes, args.max_prompt_tokens, **limits
    )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)  # before any rank starts
    if launched_by_torchrun():  # ranks > 0 would wait for steps between requests and time out
        raise ConfigError(
            "serve runs its ranks itself (--tp/--ep N); it does not run under torchrun"
        )
    with build_llm(args) as llm:
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            print(
                f"moe-overlap: warning: {args.host} is reachable from the network and no "
                "--api-key is set",
                file=sys.stderr,
            )
        text = "text and token ids" if llm.tokenizer is not None else "token ids only"
        serving = (  # printed once the address is bound, not before
            f"moe-overlap: serving {settings.model_name!r} ({text}) at "
            f"http://{args.host}:{args.port}/v1 on {llm.parallel.describe()}; Ctrl-C stops\n"
            f"moe-overlap: {llm.spec.kv_cache_summary()}"
        )
        server = Server(
            llm,
            settings,
            args.host,
            args.port,
            args.log_level,
            on_started=lambda: print(serving, file=sys.stderr, flush=True),
        )
        server.run()
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    overlaps = {mode: mode_config(mode) for mode in modes}  # a clear error for a bad name
    rates = _rates(args.rates)
    for name in ("num_requests", "output_len"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.duration is not None and not args.duration > 0:
        raise ConfigError(f"--duration={args.duration} must be a positive number of seconds")
    cfg = ModelConfig.from_hf(args.model or args.config)
    lengths = prompt_lengths(args.workload, args.num_requests, args.seed)
    context = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if max(lengths) + args.output_len > context:
        raise ConfigError(
            f"--workload {args.workload}: a {max(lengths)}-token prompt and --output-len "
            f"{args.output_len} exceed the model's context of {context} tokens"
        )
    prompts = make_prompts(lengths, cfg.vocab_size, args.seed)
    console, results = Console(width=max(Console().width, 132)), []  # the table is wide
    for mode in modes:
        kwargs = {**engine_kwargs(args), "overlap": overlaps[mode]}
        llm = LLM(args.model, **kwargs) if args.model else LLM(config=cfg, **kwargs)
        port = free_port()
        server = Server(llm, ServerSettings("bench"), port=port)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                if not thread.is_alive():
                    raise RuntimeError(f"the server for mode {mode} did not start")
                time.sleep(0.05)
            for rate in rates:
                count = round(rate * args.duration) if args.duration else len(prompts)
                sent = [prompts[i % len(prompts)] for i in range(max(count, 1))]
                console.print(f"{mode}: {len(sent)} requests at {rate:g}/s ...")
                results.append(run_load(port, sent, rate, args.output_len, args.seed, None, mode))
        finally:
            server.stop()
            thread.join()
    title = (
        f"{Path(args.model or args.config).stem}, {ParallelConfig(**layout_kwargs(args)).describe()}, "
        f"--link {args.link}, "
        f"workload {args.workload}, "
        + (f"{args.duration:g} s" if args.duration else f"{args.num_requests} requests")
        + f" of {args.output_len}-token answers per rate"
    )
    console.print(load_table(results, title))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": args.model or args.config, **layout_kwargs(args), "link": args.link}
        payload |= {"workload": args.workload, "results": [r.to_json() for r in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2))
        console.print(f"results: {args.json}")
    return 1 if any(r.errors for r in results) else 0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ConfigError(f"--rates {text!r} must be comma-separated numbers, e.g. 1,4") from None
    if not rates or not all(r > 0 for r in rates):
        raise ConfigError(f"--rates {text!r}: every rate must be a positive number")
    return rates


def load_table(results: list[LoadResult], title: str) -> Table:
    table = Table(title=title)
    for column in ("mode", "rate/s", "done/s", "tokens/s", "TTFT p50", "TTFT p99"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for column in ("ITL p50", "ITL p99", "errors", "RSS MiB"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.mode,
            f"{r.rate:g}",
            f"{r.requests_per_s:.2f}",
            f"{r.tokens_per_s:,.0f}",
            *(f"{v:.0f} ms" for v in (*r.ttft_ms, *r.itl_ms)),
            str(r.errors),
            f"{r.rss_mib[0]:,.0f}->{r.rss_mib[1]:,.0f}",
        )
    return table
