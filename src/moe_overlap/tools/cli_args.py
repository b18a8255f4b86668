"""The flags every command shares: where the model comes from, the layout, the link and the
overlap scheme (the reference systems' names), and how they become an ``LLM``."""

from __future__ import annotations

import argparse

from moe_overlap.core.device import DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES
from moe_overlap.core.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import (
    A2A_BACKENDS,
    AUTO_MODES,
    DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD,
    MODE_MISMATCH,
    OVERLAP_MODES,
    OverlapConfig,
)
from moe_overlap.engine.llm import LLM
from moe_overlap.engine.pdmux import DEFAULT_PREFILL_SPLITS
from moe_overlap.tools.layout_args import add_layout_args, layout_kwargs


def add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    src = p.add_mutually_exclusive_group(required=required)
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


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help=DTYPE_HELP)


def device_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_layout_args(p)
    add_device_args(p)
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
        choices=A2A_BACKENDS,
        default="auto",
        help="token dispatcher: torch (all-to-all over the EP ranks; needs --ep equal to the "
        "world), none (SGLang's tensor-parallel MoE: gather the tokens, run the local experts' "
        "slices, all-reduce), local (one process holds every expert), or auto (the default: "
        "local on one rank, torch when every rank owns whole experts, else none)",
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
        default=DEFAULT_MAX_NUM_SEQS,
        help="KV cache slots per rank, i.e. sequences running at once (default %(default)s)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per rank per forward; longer prompts are prefilled in chunks "
        "(default %(default)s)",
    )
    o = p.add_argument_group("overlap (at most one scheme)")
    o.add_argument(
        "--overlap",
        choices=OVERLAP_MODES,
        default=None,
        help="the scheme by name: none, tbo, sbo, dbo (as the --enable flags), or auto (ours): "
        "every forward, the mode predicted fastest from a cost model calibrated at start-up "
        "and corrected from measured forwards",
    )
    o.add_argument(
        "--auto-modes",
        type=lambda text: tuple(m.strip() for m in text.split(",") if m.strip()),
        default=AUTO_MODES,
        metavar="MODES",
        help=f"with --overlap auto: the modes it chooses among (default {','.join(AUTO_MODES)}; "
        "tbo2/tbo3 cut where estimated time balances); leaving out none forces overlap "
        "wherever an allowed mode fits",
    )
    o.add_argument(
        "--log-overlap-decisions",
        action="store_true",
        help="with --overlap auto: print each forward's choice and the predicted times",
    )
    o.add_argument(
        "--enable-two-batch-overlap",
        action="store_true",
        help="SGLang TBO: split each batch into micro-batches whose computation and "
        "all-to-all interleave layer by layer",
    )
    o.add_argument(
        "--tbo-token-distribution-threshold",
        type=float,
        default=DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD,
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
        "--tbo-mode-mismatch",
        choices=MODE_MISMATCH,
        default="off",
        help="when busy ranks run different forward modes (one prefills, one decodes): off "
        "runs that step without TBO (SGLang, default); prefill runs the prefill strategy on "
        "every rank (ours)",
    )
    o.add_argument(
        "--sbo-combine-blocks",
        type=int,
        default=2,
        help="SBO: local experts are run in this many blocks (at most one per expert), cut "
        "where the rows that cross ranks balance, each block's outputs sent back while the "
        "next computes (default 2)",
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
    o.add_argument(
        "--enable-pdmux",
        action="store_true",
        help="PD multiplexing (SGLang): prompts are prefilled whole, a range of layers per "
        "step, on a lane of their own beside the decode batch, so long prompts do not stall "
        "running decodes; not with --pp, tbo, dbo or auto, and needs attention TP 1",
    )
    o.add_argument(
        "--pdmux-prefill-splits",
        type=int,
        default=DEFAULT_PREFILL_SPLITS,
        help="with --enable-pdmux: layer ranges a prefill is cut into, one per step "
        "(default %(default)s)",
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
    if args.overlap not in (None, "none", *chosen):
        chosen.append(args.overlap)
    if len(chosen) > 1:
        raise ConfigError(
            f"overlap schemes {' and '.join(chosen)} are mutually exclusive; enable at most one"
        )
    return OverlapConfig(
        mode=chosen[0] if chosen else "none",
        tbo_token_distribution_threshold=args.tbo_token_distribution_threshold,
        num_micro_batches=args.num_micro_batches,
        tbo_min_tokens=args.tbo_min_tokens,
        tbo_split_policy=args.tbo_split_policy,
        tbo_mode_mismatch=args.tbo_mode_mismatch,
        dbo_decode_token_threshold=args.dbo_decode_token_threshold,
        dbo_prefill_token_threshold=args.dbo_prefill_token_threshold,
        sbo_combine_blocks=args.sbo_combine_blocks,
        sbo_comm_sms=args.sbo_comm_sms,
        moe_a2a_backend=args.moe_a2a_backend,
        log_overlap_decisions=args.log_overlap_decisions,
        auto_modes=args.auto_modes,
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        seed=args.seed,
        **layout_kwargs(args),
        load_balance_method=args.load_balance_method,
        enable_pdmux=args.enable_pdmux,
        pdmux_prefill_splits=args.pdmux_prefill_splits,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        overlap=overlap_from_args(args),
        link=args.link,
        timeout_s=args.timeout,
        **device_kwargs(args),
    )


def build_llm(args: argparse.Namespace) -> LLM:
    if args.model:
        return LLM(args.model, **engine_kwargs(args))
    return LLM(config=ModelConfig.from_hf(args.config), **engine_kwargs(args))
