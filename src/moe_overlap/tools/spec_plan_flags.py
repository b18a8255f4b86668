"""``moe-overlap plan``'s speculative decoding flags (a base of ``command_flags.PlanFlags``):
the verify width, the accept length and what a draft costs (``planner/speculative.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.engine.args import setting
from moe_overlap.planner.speculative import DRAFTERS


@dataclass
class SpeculativePlanFlags:
    speculative_num_draft_tokens: int | None = setting(
        None,
        "also plan speculative decoding with K rows per sequence in the verify forward (the "
        "last token and K - 1 drafts, SGLang's flag): its draft and verify cost against plain "
        "decode, the speed-up, and whether TBO pays on the verify forward (needs "
        "--accept-length; plans a decode workload)",
        parse=int,
        metavar="K",
    )
    accept_length: float | None = setting(
        None,
        "tokens a verification gives per sequence, the bonus token included (1 to K; our "
        "/metrics' and SGLang's accept length)",
        parse=float,
        metavar="A",
    )
    speculative_drafter: str = setting(
        DRAFTERS[0],
        "what a draft costs: ngram (a host lookup, nothing on the GPU) or mtp (one decoder "
        "layer and the LM head per draft)",
        choices=DRAFTERS,
    )
