"""The ``moe-overlap`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_overlap.config import ConfigError, ModelConfig
from moe_overlap.engine.request import InvalidRequestError, SamplingParams
from moe_overlap.model.loader import CheckpointError


def add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model",
        metavar="DIR",
        help="checkpoint directory: config.json and *.safetensors in the Hub layout",
    )
    src.add_argument(
        "--config",
        metavar="JSON",
        help="a Hugging Face config.json; the weights are seeded random (see --seed)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for random weights (with --config) and for sampling (default 0)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks started on this machine (default 1: one process)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest sequence served (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="KV cache slots per rank, i.e. sequences running at once (default 16)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per rank per forward; longer prompts are prefilled in chunks",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        seed=args.seed,
        ep=args.ep,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def build_llm(args: argparse.Namespace):
    from moe_overlap.engine.llm import LLM

    if args.model:
        return LLM(args.model, **engine_kwargs(args))
    return LLM(config=ModelConfig.from_hf(args.config), **engine_kwargs(args))


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids {text!r} must be comma-separated integers, e.g. 1,2,3"
        ) from None


def cmd_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    with build_llm(args) as llm:
        for out in llm.generate(args.prompt_ids, params):
            print(",".join(map(str, out.token_ids)))
    return 0


def cmd_make_model(args: argparse.Namespace) -> int:
    from moe_overlap.model.loader import build_model, save_checkpoint

    model = build_model(ModelConfig.from_hf(args.config), seed=args.seed)
    save_checkpoint(model, args.out)
    print(f"wrote {args.out}/config.json and {args.out}/model.safetensors")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-overlap",
        description="Mixture-of-Experts inference across expert-parallel ranks.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate tokens for prompts given as token ids",
        description="Generate and print one line of comma-separated ids per prompt.",
    )
    add_model_args(gen)
    add_engine_args(gen)
    gen.add_argument(
        "--prompt-ids",
        type=parse_ids,
        action="append",
        required=True,
        metavar="IDS",
        help="a prompt as comma-separated token ids; repeat for a batch",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)"
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k best; 0 disables")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past the EOS token")
    gen.set_defaults(func=cmd_generate)

    make = sub.add_parser(
        "make-model",
        help="write a seeded random checkpoint for a config",
        description="Write config.json and model.safetensors (Hub layout).",
    )
    make.add_argument("--config", required=True, metavar="JSON", help="a Hugging Face config.json")
    make.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    make.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    make.set_defaults(func=cmd_make_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, CheckpointError, InvalidRequestError) as exc:
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
