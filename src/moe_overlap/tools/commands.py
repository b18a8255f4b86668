"""The ``moe-overlap`` commands: their parser and what each runs (``cli.py`` is the entry)."""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
from collections.abc import Sequence

from moe_overlap.core.errors import ConfigError
from moe_overlap.distributed.netns import (
    DEFAULT_PREFIX,
    LinkUnavailable,
    cleanup_stale,
    stale_namespaces,
)
from moe_overlap.engine.request import DEFAULT_TEMPERATURE, InvalidRequestError, SamplingParams
from moe_overlap.model.loader import CheckpointError
from moe_overlap.tools.bench_cli import add_bench_commands
from moe_overlap.tools.bench_engine import add_bench_engine_command
from moe_overlap.tools.bench_serve_cli import add_bench_serve_command
from moe_overlap.tools.cli_args import add_engine_args, add_model_args, build_llm
from moe_overlap.tools.command_flags import ConfigFileFlag
from moe_overlap.tools.eplb_cli import add_eplb_command
from moe_overlap.tools.flags import add_fields, expand_config, switches
from moe_overlap.tools.make_model import add_make_model_command
from moe_overlap.tools.plan_cli import add_plan_command
from moe_overlap.tools.serve_cli import add_serve_commands


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]  # an empty item is no id: refused, not dropped
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids {text!r} must be comma-separated integers, e.g. 1,2,3"
        ) from None


SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """generate's sampling flags as SamplingParams; a refusal names the flag, not the field."""
    if args.max_new_tokens < 1:  # SamplingParams' message offers prompt_logprobs: no flag
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    try:
        chosen = {name: getattr(args, name) for name in SAMPLING_FLAGS}
        return SamplingParams(ignore_eos=args.ignore_eos, **chosen)
    except InvalidRequestError as exc:
        text = str(exc)
        name = text.partition("=")[0]
        if name in SAMPLING_FLAGS:  # "top_p=2.0 must ..." -> "--top-p=2.0 must ..."
            text = "--" + name.replace("_", "-") + text[len(name) :]
        raise ConfigError(text) from None


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    with build_llm(args) as llm:
        for out in llm.generate(args.prompt_ids or args.prompt, params):
            print(out.text if args.prompt else ",".join(map(str, out.token_ids)))
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    removed = cleanup_stale(args.prefix)
    print(f"removed {len(removed)} network namespace(s) left by runs that are gone")
    for name in removed:
        print(f"  {name}")
    left = stale_namespaces(args.prefix)
    if left:
        raise LinkUnavailable(
            f"could not remove {len(left)} network namespace(s) ({', '.join(left)}); "
            "deleting them needs root"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-overlap",
        description="Mixture-of-Experts inference across expert-parallel ranks.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_bench_commands(sub)
    add_bench_engine_command(sub)
    add_serve_commands(sub)
    add_bench_serve_command(sub)
    add_plan_command(sub)
    add_eplb_command(sub)
    _add_utilities(sub)
    for command in sub.choices.values():  # errors print the command's usage, not the top's
        command.set_defaults(command_parser=command)
        add_fields(command, ConfigFileFlag)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate for prompts given as text or token ids",
        description="Generate and print one line per prompt: text for --prompt, "
        "comma-separated ids for --prompt-ids.",
    )
    add_model_args(gen)
    add_engine_args(gen)
    prompts = gen.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompt-ids",
        type=parse_ids,
        action="append",
        metavar="IDS",
        help="a prompt as comma-separated token ids; repeat for a batch (prints ids)",
    )
    prompts.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt as text (the model directory's tokenizer); repeat for a batch (prints text)",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_TEMPERATURE,
        help=f"0 is greedy (default {DEFAULT_TEMPERATURE}, as vLLM and the server)",
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k best; 0 disables")
    gen.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than MIN_P x the likeliest (0 to 1; 0, the default, disables)",
    )
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the EOS token")
    gen.set_defaults(func=cmd_generate)


def _add_utilities(sub: argparse._SubParsersAction) -> None:
    add_make_model_command(sub)
    clean = sub.add_parser(
        "cleanup",
        help="remove network namespaces left by --link netns runs that were killed",
        description="Delete the network namespaces (with their bridges and shaped links) whose "
        "creating process is gone. Namespaces of running engines are kept.",
    )
    clean.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help=f"namespace name prefix (default {DEFAULT_PREFIX})"
    )
    clean.set_defaults(func=cmd_cleanup)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: ranks stopped, namespaces removed


def package_version() -> str:
    try:
        return importlib.metadata.version("moe_overlap")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = expand_config(sys.argv[1:] if argv is None else argv, switches(parser))
    except ConfigError as exc:
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "trust_remote_code", False):
        print(
            "moe-overlap: note: --trust-remote-code is accepted, but no code from a checkpoint "
            "runs here: every model family is this package's own",
            file=sys.stderr,
        )
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("moe-overlap: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, CheckpointError, InvalidRequestError, ValueError) as exc:
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a rank failed, or the link could not be built
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # an output that could not be written after all
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 1
