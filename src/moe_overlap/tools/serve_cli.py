"""``moe-overlap serve``: the engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from moe_overlap.core.errors import ConfigError
from moe_overlap.runtime.torchrun import launched_by_torchrun
from moe_overlap.server.guards import ServerSettings
from moe_overlap.server.observability import configure_logging
from moe_overlap.server.run import Server
from moe_overlap.tools.cli_args import (
    add_engine_args,
    add_model_args,
    build_llm,
)


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
        default="info",
        help="log level of the server's loggers and uvicorn's (default info: a line per "
        "finished request and a throughput line every 10 s while busy; warning: errors only)",
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
        configure_logging(args.log_level)
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
