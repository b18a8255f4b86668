"""``--a2a-mode``: which all-to-all a step's dispatch uses (SGLang's ``--deepep-mode``).

``normal`` sizes each all-to-all from the counts it reads back (any number of tokens);
``low_latency`` sends fixed-capacity blocks the host never sizes (``dispatch/low_latency.py``:
no read of the device, so a CUDA graph can hold the step), for micro-batches of at most
``--num-max-dispatch-tokens-per-rank`` tokens; ``auto`` takes low-latency for a decode step
(a speculative target-verify step too, its k + 1 rows a sequence counted against the cap)
and normal for anything that prefills, as SGLang's ``auto`` does, on CUDA only: over gloo the
fixed blocks cross whole (padding included) and no graph holds the step, so on CPU ``auto``
is normal throughout.

Every rank of an expert-parallel group must take the same one, or their collectives would not
match: a step's choice is made from every data-parallel group's batch, which every rank
receives with the step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from moe_overlap.core.batch import ForwardBatch, ForwardMode, most_tokens
from moe_overlap.core.errors import ConfigError


class A2AMode(enum.StrEnum):
    """``--a2a-mode``: the all-to-all a step's dispatch uses."""

    AUTO = "auto"  # low-latency for decode steps on CUDA, normal otherwise
    NORMAL = "normal"  # sized from the counts read back: any number of tokens
    LOW_LATENCY = "low_latency"  # fixed-capacity blocks, nothing read back


class Backend(enum.StrEnum):
    """``--moe-a2a-backend``: the dispatcher a rank builds (``dispatch/factory.py``)."""

    AUTO = "auto"  # local on one rank, else torch when moe-TP is 1, else none
    LOCAL = "local"  # one rank holds every expert: no communication
    TORCH = "torch"  # the all-to-all over torch collectives
    NONE = "none"  # SGLang's tensor-parallel MoE: dp_gather, partial experts, all-reduce


class DispatchDtype(enum.StrEnum):
    """``--moe-dispatch-dtype``: what the dispatch's rows travel as (``dispatch/fp8_rows.py``)."""

    AUTO = "auto"  # the run dtype (--dtype), as the rows are
    FP8 = "fp8"  # float8_e4m3fn with a float32 scale per token and 128 columns


A2A_MODES = tuple(A2AMode)
DISPATCH_DTYPES = tuple(DispatchDtype)
A2A_BACKENDS = tuple(Backend)
# vLLM's --all2all-backend values that name one of ours; the others name other data paths
VLLM_BACKENDS = {"deepep_low_latency": "low_latency", "deepep_high_throughput": "normal"}
DEFAULT_MAX_DISPATCH_TOKENS = 128  # SGLang's --num-max-dispatch-tokens-per-rank


# SGLang's --moe-a2a-backend deepep (its --deepep-mode names the layout) and the batch-overlap
# reference's deepep_low_latency and deepep_normal (the layout in the name): our all-to-all
DEEPEP_BACKENDS = {"deepep": None, "deepep_normal": "normal", "deepep_low_latency": "low_latency"}


def parse_a2a_mode(text: str) -> str:
    """A flag's value: ours, SGLang's (the same names) or vLLM's DeepEP backend names."""
    return VLLM_BACKENDS.get(text, text)


def resolve_deepep(backend: str, mode: str) -> tuple[str, str]:
    """(backend, a2a mode) for ``--moe-a2a-backend`` and ``--a2a-mode``: a DeepEP name is the
    all-to-all (``torch``), in the layout its name gives where it gives one."""
    if backend not in DEEPEP_BACKENDS:
        return backend, mode
    named = DEEPEP_BACKENDS[backend]
    if named is not None and mode not in (A2AMode.AUTO, named):
        raise ConfigError(
            f"--moe-a2a-backend {backend} names the {named} layout but --a2a-mode is {mode}; "
            "drop one of them"
        )
    return Backend.TORCH, named or mode


def rank_share(tokens: int, share: int) -> int:
    """The most of ``tokens`` one rank sends where ``share`` attention-TP ranks cut them
    (``dispatch/scatter.py: shares``)."""
    return -(-tokens // share)


def over_capacity(tokens: int, capacity: int) -> ConfigError:
    """The refusal of a step or micro-batch of ``tokens`` tokens on one rank."""
    return ConfigError(
        f"a dispatch of {tokens} tokens on one rank (the step's, or its largest micro-batch's "
        f"where the overlap mode splits it) exceeds the low-latency dispatch's "
        f"capacity (--num-max-dispatch-tokens-per-rank={capacity}); raise it, lower "
        "--max-num-batched-tokens, or use --a2a-mode auto (low-latency for decode only)"
    )


_DECODING = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


def step_a2a_mode(
    asked: str,
    batches: Sequence[ForwardBatch],
    capacity: int,
    available: bool,
    on_gpu: bool = True,
    dispatch_rows: Callable[[Sequence[ForwardBatch]], int] = most_tokens,
    share: int = 1,
) -> str:
    """``normal`` or ``low_latency`` for a step whose groups run ``batches``, the same on every
    rank. ``available``: this layout built a low-latency dispatcher (one all-to-all group, no
    pipeline or PD-mux lane); ``on_gpu``: it runs on CUDA (``auto`` takes low-latency only
    there, for decode and target-verify steps whose rows fit). ``dispatch_rows``: the most
    tokens one dispatch carries on any rank (the overlap scheme's largest micro-batch; the
    whole batch without one), which ``capacity`` bounds, as DeepEP's bounds each dispatch
    call: TBO's decode of 256 sequences fits the default 128. ``share``: the attention-TP
    ranks that cut each dispatch's tokens among them (each sends at most ``ceil(rows /
    share)``). An explicit ``low_latency`` over the capacity is refused here, before any rank
    sends a row."""
    if asked == A2AMode.NORMAL or (asked == A2AMode.AUTO and not (available and on_gpu)):
        return A2AMode.NORMAL
    tokens = rank_share(most_tokens(batches), share)
    if tokens > capacity:  # only then can a split matter (a micro-batch is never larger)
        tokens = rank_share(dispatch_rows(batches), share)
    if asked == A2AMode.AUTO:
        # a verify batch is decode with k + 1 rows a sequence: the rows count toward the cap
        decoding = all(b.mode in _DECODING for b in batches)
        return A2AMode.LOW_LATENCY if decoding and 0 < tokens <= capacity else A2AMode.NORMAL
    if not available:
        raise ConfigError(
            "--a2a-mode low_latency needs the all-to-all dispatcher without --pp or "
            "--enable-pdmux; use --a2a-mode auto or normal"
        )
    if tokens > capacity:
        raise over_capacity(tokens, capacity)
    return A2AMode.LOW_LATENCY
