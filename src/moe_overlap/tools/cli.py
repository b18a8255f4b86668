"""The ``moe-overlap`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_overlap.config import ConfigError, ModelConfig, OverlapConfig
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


def add_link_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--link",
        default="none",
        metavar="SPEC",
        help="how ranks talk: none (loopback), netns:RATE (each rank in a network namespace, "
        "links shaped by tc tbf, e.g. netns:2gbit; needs root), or model:BANDWIDTH,LATENCY "
        "(a modelled delay, e.g. model:2gbit,50us)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks started on this machine (default 1: one process)",
    )
    add_link_arg(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds any collective may wait before the engine stops (default 60)",
    )
    p.add_argument(
        "--moe-a2a-backend",
        choices=("torch", "local", "none"),
        default=None,
        help="token dispatcher: torch (all-to-all over torch.distributed, the default "
        "with --ep > 1) or local (one process)",
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
    o = p.add_argument_group("overlap (at most one scheme)")
    o.add_argument(
        "--enable-two-batch-overlap",
        action="store_true",
        help="SGLang TBO: split each batch into micro-batches whose computation and "
        "all-to-all interleave layer by layer",
    )
    o.add_argument(
        "--tbo-token-distribution-threshold",
        type=float,
        default=0.48,
        help="two-chunk overlap: cut a sequence in two when the balanced split puts "
        "less than this share of tokens in one micro-batch (0 disables; <= 0.5)",
    )
    o.add_argument(
        "--num-micro-batches",
        type=int,
        default=2,
        help="micro-batches for TBO (default 2; more cut tokens evenly)",
    )
    o.add_argument(
        "--enable-single-batch-overlap",
        action="store_true",
        help="SGLang SBO: inside each MoE layer, send finished experts' outputs while "
        "the rest compute, and run shared experts during the dispatch",
    )
    o.add_argument(
        "--tbo-min-tokens",
        type=int,
        default=2,
        help="TBO runs only when every busy rank has at least this many tokens this step "
        "(default 2); raise it where small batches lose to the split's overhead",
    )
    o.add_argument(
        "--tbo-split-policy",
        choices=("tokens", "time"),
        default="tokens",
        help="where two-chunk cuts: tokens halves the tokens (SGLang); time balances estimated "
        "time (a later chunk also attends over the earlier one)",
    )
    o.add_argument(
        "--sbo-combine-blocks",
        type=int,
        default=2,
        help="SBO: local experts are run in this many blocks, each block's outputs "
        "sent back while the next computes (default 2)",
    )
    o.add_argument(
        "--sbo-comm-sms",
        type=int,
        default=3,
        help="SBO on CUDA: SMs reserved for communication (recorded; CPU ignores it)",
    )
    o.add_argument(
        "--enable-dbo",
        action="store_true",
        help="vLLM DBO: two micro-batches on two threads handing a baton at each "
        "dispatch and combine",
    )
    o.add_argument(
        "--dbo-decode-token-threshold",
        type=int,
        default=32,
        help="DBO runs on decode batches of at least this many tokens (default 32)",
    )
    o.add_argument(
        "--dbo-prefill-token-threshold",
        type=int,
        default=512,
        help="DBO runs on prefill batches of at least this many tokens (default 512)",
    )


def overlap_from_args(args: argparse.Namespace) -> OverlapConfig:
    chosen = [
        name
        for name, on in (
            ("tbo", args.enable_two_batch_overlap),
            ("sbo", args.enable_single_batch_overlap),
            ("dbo", args.enable_dbo),
        )
        if on
    ]
    if len(chosen) > 1:
        raise ConfigError(
            f"overlap schemes {' and '.join(chosen)} are mutually exclusive; enable at most one"
        )
    backend = args.moe_a2a_backend or ("local" if args.ep == 1 else "torch")
    return OverlapConfig(
        mode=chosen[0] if chosen else "none",
        tbo_token_distribution_threshold=args.tbo_token_distribution_threshold,
        num_micro_batches=args.num_micro_batches,
        tbo_min_tokens=args.tbo_min_tokens,
        tbo_split_policy=args.tbo_split_policy,
        dbo_decode_token_threshold=args.dbo_decode_token_threshold,
        dbo_prefill_token_threshold=args.dbo_prefill_token_threshold,
        sbo_combine_blocks=args.sbo_combine_blocks,
        sbo_comm_sms=args.sbo_comm_sms,
        moe_a2a_backend=backend,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        seed=args.seed,
        ep=args.ep,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        overlap=overlap_from_args(args),
        link=args.link,
        timeout_s=args.timeout,
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
    from moe_overlap.tools.bench_cli import add_bench_commands

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

    add_bench_commands(sub)

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
    except (ConfigError, CheckpointError, InvalidRequestError, ValueError) as exc:
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a rank failed, or the link could not be built
        print(f"moe-overlap: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
