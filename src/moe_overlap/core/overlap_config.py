"""Which overlap scheme runs and its knobs, under the reference systems' flag names."""

from __future__ import annotations

from dataclasses import dataclass

from moe_overlap.core.a2a_mode import (
    A2A_BACKENDS,
    A2A_MODES,
    DEFAULT_MAX_DISPATCH_TOKENS,
    DISPATCH_DTYPES,
    A2AMode,
    Backend,
    DispatchDtype,
)
from moe_overlap.core.errors import ConfigError, is_finite_number, is_int
from moe_overlap.core.overlap_modes import MODES, NONE

SPLIT_POLICIES = ("tokens", "time")
MODE_MISMATCH = ("off", "prefill")  # off: SGLang; prefill: ours
# TBO decode: staggered (SGLang: five stages a layer, micro-batch 1 two behind), lockstep (ours:
# the prefill cut, both in step, so each transfer flies under the other micro-batch's stage)
DECODE_ORDERS = ("staggered", "lockstep")
AUTO_MODES = tuple(MODES.auto_choices())  # what auto chooses among (ties: the earlier)
DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD = 0.48  # SGLang's default


@dataclass(frozen=True)
class OverlapConfig:
    mode: str = NONE.name  # a name in core/overlap_modes.py: MODES
    tbo_token_distribution_threshold: float = DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD
    num_micro_batches: int = 2
    tbo_min_tokens: int = 2  # a rank with fewer tokens votes against micro-batching this step
    # where two-chunk cuts: "tokens" halves the tokens (SGLang), "time" balances estimated cost
    tbo_split_policy: str = "tokens"
    # busy ranks in different forward modes: "off" skips TBO this step (SGLang), "prefill" runs
    # the prefill strategy on every rank (ours)
    tbo_mode_mismatch: str = "off"
    tbo_decode_order: str = "staggered"  # DECODE_ORDERS
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    moe_a2a_backend: str = Backend.AUTO
    a2a_mode: str = A2AMode.AUTO  # core/a2a_mode.py: normal, low_latency, or per step
    num_max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS  # low-latency capacity
    # the dispatch's rows: the run dtype, or FP8 with per-128-column scales (read when the
    # ranks build their dispatchers, as moe_a2a_backend is)
    moe_dispatch_dtype: str = DispatchDtype.AUTO
    sbo_combine_blocks: int = 2  # SBO: combine all-to-alls per MoE layer (local expert blocks)
    sbo_comm_sms: int = 3  # SBO on CUDA: SMs reserved for communication (SGLang, Hopper)
    log_overlap_decisions: bool = False  # auto: print each forward's choice and predictions
    auto_modes: tuple[str, ...] = AUTO_MODES  # auto chooses among these (none if none fits)

    def __post_init__(self) -> None:
        for name, choices in (
            ("mode", tuple(MODES)),
            ("tbo_split_policy", SPLIT_POLICIES),
            ("tbo_mode_mismatch", MODE_MISMATCH),
            ("tbo_decode_order", DECODE_ORDERS),
            ("moe_a2a_backend", A2A_BACKENDS),
            ("a2a_mode", A2A_MODES),
            ("moe_dispatch_dtype", DISPATCH_DTYPES),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{_flag(name)}={getattr(self, name)!r} must be one of {', '.join(choices)}"
                )
        known = MODES.auto_choices()
        if not self.auto_modes or not set(self.auto_modes) <= set(known):
            raise ConfigError(
                f"--auto-modes={','.join(self.auto_modes)!r} must name some of {', '.join(known)}"
            )
        threshold = self.tbo_token_distribution_threshold
        if not is_finite_number(threshold):
            raise ConfigError(
                f"{_flag('tbo_token_distribution_threshold')}={threshold!r} must be a number"
            )
        if not 0 <= threshold <= 0.5:
            raise ConfigError(
                f"{_flag('tbo_token_distribution_threshold')}={threshold} must be in [0, 0.5] "
                f"(0 disables two-chunk splitting; default {DEFAULT_TBO_TOKEN_DISTRIBUTION_THRESHOLD})"
            )
        for name, minimum in (
            ("num_micro_batches", 2),
            ("tbo_min_tokens", 1),
            ("dbo_decode_token_threshold", 1),
            ("dbo_prefill_token_threshold", 1),
            ("sbo_combine_blocks", 1),
            ("sbo_comm_sms", 1),
            ("num_max_dispatch_tokens_per_rank", 1),
        ):
            value = getattr(self, name)
            if not is_int(value) or value < minimum:
                raise ConfigError(f"{_flag(name)}={value!r} must be an integer >= {minimum}")


def _flag(name: str) -> str:
    return "overlap" if name == "mode" else "--" + name.replace("_", "-")
