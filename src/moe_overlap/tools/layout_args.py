"""SGLang's layout flags (``--tp --dp --enable-dp-attention --ep --pp``) and the DP
controller's ``--load-balance-method``, shared by every command that starts ranks."""

from __future__ import annotations

import argparse

from moe_overlap.engine.load_balance import DEFAULT_LOAD_BALANCE_METHOD, LOAD_BALANCE_METHODS


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """SGLang's layout flags, with SGLang's meanings."""
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of one replica, started on this machine (default 1). "
        "Attention, dense MLPs and the vocabulary split over tp/dp ranks",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data parallelism: with --enable-dp-attention, attention-DP groups inside --tp, "
        "each with its own requests and KV cache, sharing the MoE; without it, independent "
        "replicas of the whole layout (world = dp x tp) (default 1)",
    )
    p.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="run attention data parallel: --dp groups of --tp/--dp ranks each",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size: routed experts split --ep ways inside --tp (ep < tp: each "
        "expert's width split tp/ep ways too); with --tp 1, --ep N is pure expert parallelism "
        "over N ranks (default %(default)s)",
    )

    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages: contiguous layer ranges (the embedding on the first, the norm "
        "and LM head on the last), each stage --tp ranks; world = dp x pp x tp (default 1)",
    )
    p.add_argument(
        "--load-balance-method",
        choices=LOAD_BALANCE_METHODS,
        default=DEFAULT_LOAD_BALANCE_METHOD,
        help="which data-parallel group (replica or attention-DP group) a new request joins: "
        "round_robin (in turn; SGLang's default), shortest_queue (fewest requests) or "
        "minimum_tokens (fewest tokens left to compute)",
    )


def layout_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        tp=args.tp,
        dp=args.dp,
        ep=args.ep,
        enable_dp_attention=args.enable_dp_attention,
        pp=args.pp,
    )
