"""Whether a set of engine settings is legal: ``check_settings`` is the one place every
refusal is asked, each a ConfigError naming the bad value and the fix. The layout's own
arithmetic lives with the layout (``ParallelConfig``, ``layout_for``, ``resolve_backend``,
``check_model_fits``); this function runs all of them in order, before any rank starts."""

from __future__ import annotations

import math

from moe_overlap.core.device import ranks_on_this_node, resolve_device, torch_dtype
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig, check_model_fits
from moe_overlap.dispatch.factory import resolve_backend
from moe_overlap.distributed.layout import layout_for
from moe_overlap.distributed.link import LinkSpec, parse_link
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.engine.load_balance import check_method


def check_settings(
    args: EngineArgs, cfg: ModelConfig, overlap: OverlapConfig
) -> tuple[ParallelConfig, LinkSpec, str]:
    """Refuse illegal settings; return the layout, the parsed link and the resolved device."""
    for name, minimum in (("max_num_seqs", 1), ("seed", 0), ("max_num_batched_tokens", 1)):
        _check_int(name, getattr(args, name), minimum)
    if args.max_model_len is not None:
        _check_int("max_model_len", args.max_model_len, minimum=1)
    timeout = args.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise ConfigError(f"--timeout={timeout!r} must be a number of seconds")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout={timeout!r} must be a positive number of seconds")
    par = ParallelConfig(**args.layout_kwargs())
    check_method(args.load_balance_method)
    torch_dtype(args.dtype)
    device = resolve_device(args.device, ranks_on_this_node(par.world_size))
    layout_for(par)  # SGLang's refusals, naming the flags
    check_model_fits(cfg, par)
    try:
        link = parse_link(args.link)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_layout(par, overlap, link)
    check_pdmux(args.enable_pdmux, args.pdmux_prefill_splits, par, overlap)
    if args.enable_pdmux and cfg.is_hybrid:  # the prefill lane has no recurrent-state cache
        raise ConfigError(f"--enable-pdmux does not support model_type={cfg.model_type}")
    return par, link, device


def _check_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be an integer >= {minimum}")


def check_pdmux(on: bool, splits: object, par: ParallelConfig, overlap: OverlapConfig) -> None:
    """SGLang's refusals for PD multiplexing, and ours (the prefill lane's MoE has its own
    groups, but attention TP would share the model's)."""
    if not is_int(splits) or splits < 1:
        raise ConfigError(f"--pdmux-prefill-splits={splits!r} must be an integer >= 1")
    if not on:
        return
    if par.pp > 1:
        raise ConfigError("--enable-pdmux does not combine with --pp (as in SGLang); drop one")
    if overlap.mode in ("tbo", "dbo", "auto"):
        raise ConfigError(
            f"--enable-pdmux does not combine with overlap {overlap.mode} (SGLang refuses "
            "two-batch overlap with it); use none or sbo"
        )
    if par.attn_tp > 1:
        raise ConfigError(
            f"--enable-pdmux needs attention TP 1, not {par.attn_tp} (--tp {par.tp} / --dp "
            f"{par.attn_dp}): the prefill lane shares the model's attention-TP group; use "
            "--enable-dp-attention with --dp equal to --tp, or pure --ep"
        )


def check_layout(par: ParallelConfig, overlap: OverlapConfig, link: LinkSpec) -> None:
    """The reference systems' refusals, each with the fix."""
    resolve_backend(overlap.moe_a2a_backend, par)
    if overlap.mode == "auto" and par.pp > 1:
        raise ConfigError(
            f"--overlap auto with --pp {par.pp}: auto calibrates on whole forwards, which a "
            "pipeline stage does not run; choose tbo, sbo or dbo (they run inside each stage)"
        )
    if overlap.mode == "dbo" and par.replica_size == 1:
        raise ConfigError(
            "--enable-dbo needs more than one rank to overlap with; set --ep 2 or --tp 2 or more"
        )
    if par.replica_size == 1 and link.kind != "none":
        raise ConfigError(
            f"--link {link.spec} needs more than one rank (--ep or --tp > 1): one process has "
            "no link to emulate"
        )
