"""``moe-overlap serve``: the engine behind an OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_overlap.core.errors import ConfigError
from moe_overlap.runtime.torchrun import launched_by_torchrun
from moe_overlap.server.settings import ServerSettings
from moe_overlap.tools.cli_args import (
    add_engine_args,
    add_model_args,
    build_llm,
    model_path,
)
from moe_overlap.tools.flags import add_fields, from_args


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streamed or whole), "
        "/v1/models and /health. Requests that arrive while others run join the batch at "
        "the next step. Ctrl-C or SIGTERM stops the server and every rank.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the checkpoint directory, as vLLM's `vllm serve MODEL` takes it (or --model)",
    )
    add_model_args(serve)
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_fields(p, ServerSettings)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    path = Path(model_path(args))
    source = path.stem if path.suffix == ".json" else path.resolve().name
    return from_args(ServerSettings, args, model_name=args.served_model_name or source)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ConfigError(
                f"serve {args.model_tag} --model {args.model}: give the model once, either way"
            )
        args.model = args.model_tag
    settings = settings_from_args(args)  # before any rank starts
    if launched_by_torchrun():  # ranks > 0 would wait for steps between requests and time out
        raise ConfigError(
            "serve runs its ranks itself (--tp/--ep N); it does not run under torchrun"
        )
    # the serving stack (FastAPI, uvicorn) loads only for the commands that serve, so bench
    # and plan run where it is not installed (a GPU machine with torch alone)
    from moe_overlap.server.observability import configure_logging
    from moe_overlap.server.run import Server, listening_socket

    sock = listening_socket(args.host, args.port)  # a port in use: named before the model loads
    with sock, build_llm(args) as llm:
        configure_logging(args.log_level)
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            print(
                f"moe-overlap: warning: {args.host} is reachable from the network and no "
                "--api-key is set",
                file=sys.stderr,
            )
        text = "text and token ids" if llm.tokenizer is not None else "token ids only"
        summary = llm.spec.kv_cache_summary()

        def serving() -> None:  # once the address is bound (port 0: the one chosen), not before
            print(
                f"moe-overlap: serving {settings.model_name!r} ({text}) at "
                f"http://{args.host}:{server.port}/v1 on {llm.parallel.describe()}; Ctrl-C "
                f"stops\nmoe-overlap: {summary}",
                file=sys.stderr,
                flush=True,
            )

        server = Server(
            llm, settings, args.host, args.port, args.log_level, on_started=serving, sock=sock
        )
        server.run()
    return 0
