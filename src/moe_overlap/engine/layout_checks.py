"""Whether a set of engine settings is legal: ``check_settings`` is the one place every
refusal is asked, each a ConfigError naming the bad value and the fix, before any rank
starts. Single values are checked here; every layout rule (sizes, the model's fit, the modes
and backend a layout allows, PD multiplexing) is ``core/layout_rules.py: check_layout``."""

from __future__ import annotations

import math

from moe_overlap.core.a2a_mode import DEEPEP_BACKENDS, A2AMode, rank_share
from moe_overlap.core.attention_plan import ATTENTION_BACKENDS, GPU_PAGE_MULTIPLE
from moe_overlap.core.device import ranks_on_this_node, resolve_device, resolve_dtype
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.link import LinkSpec, parse_link
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.engine.load_balance import check_method
from moe_overlap.engine.spec_config import check_speculation


def check_settings(
    args: EngineArgs, cfg: ModelConfig, overlap: OverlapConfig, emulate_peers: int = 0
) -> tuple[ParallelConfig, LinkSpec, str]:
    """Refuse illegal settings; return the layout, the parsed link and the resolved device
    (``emulate_peers``: the bench's ``--emulate-peers``; the layout stays the one process)."""
    for name, minimum in (
        ("max_num_seqs", 1),
        ("seed", 0),
        ("max_num_batched_tokens", 1),
        ("cuda_graph_max_bs", 1),
    ):
        _check_int(name, getattr(args, name), minimum)
    for name in ("max_model_len", "max_total_tokens", "kv_cache_memory"):
        if getattr(args, name) is not None:
            _check_int(name, getattr(args, name), minimum=1)
    _check_fraction("mem_fraction_static", args.mem_fraction_static)
    timeout = args.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ConfigError(f"--timeout={timeout!r} must be a number of seconds")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout={timeout!r} must be a positive number of seconds")
    par = args.parallel_config()
    check_method(args.load_balance_method)
    device = resolve_device(args.device, ranks_on_this_node(par.world_size))
    _check_attention_backend(args.attention_backend, args.page_size, device)
    resolve_dtype(args.dtype, device)  # a clear error for an unknown name
    _check_int("pdmux_prefill_splits", args.pdmux_prefill_splits, minimum=1)
    try:
        link = parse_link(args.link)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    emulated = link.spec if link.shaped else None
    redundant = args.ep_num_redundant_experts  # EPLB's slots: E + R must divide over --ep
    check_layout(par, cfg, overlap, emulated, args.enable_pdmux, emulate_peers, redundant)
    check_speculation(args.speculative(), cfg, args.enable_pdmux)
    cap, step = overlap.num_max_dispatch_tokens_per_rank, args.max_num_batched_tokens
    # under attention TP each rank of a group sends its share of the group's tokens
    if overlap.a2a_mode == A2AMode.LOW_LATENCY and rank_share(step, par.attn_tp) > cap:
        asked = args.moe_a2a_backend  # the reference's deepep_low_latency names the layout too
        flag = (
            f"--moe-a2a-backend {asked}" if asked in DEEPEP_BACKENDS else "--a2a-mode low_latency"
        )
        raise ConfigError(
            f"{flag} carries at most --num-max-dispatch-tokens-per-rank={cap} tokens per rank, "
            f"but --max-num-batched-tokens={step} lets a step send more (over attention TP "
            f"{par.attn_tp}); lower it to {cap * par.attn_tp}, raise the capacity, or use "
            "--a2a-mode auto (low-latency for decode steps only)"
        )
    return par, link, device


def _check_fraction(name: str, value: object) -> None:
    """Refuse a share outside (0, 1] on every device, not only where a GPU would read it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be a share in (0, 1]")


def _check_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be an integer >= {minimum}")


def _check_attention_backend(backend: str, page_size: int, device: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        choices = ", ".join(ATTENTION_BACKENDS)
        raise ConfigError(f"--attention-backend={backend!r} must be one of {choices}")
    if backend == "flex_attention" and device == "cuda" and page_size % GPU_PAGE_MULTIPLE:
        raise ConfigError(
            f"--attention-backend flex_attention on a GPU reads pages in key tiles of 16 or "
            f"more: --page-size={page_size} must be a multiple of {GPU_PAGE_MULTIPLE}"
        )
