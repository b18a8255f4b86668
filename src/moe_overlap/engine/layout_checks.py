"""The reference systems' refusals of flag combinations, each a ConfigError naming the fix."""

from __future__ import annotations

from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.factory import resolve_backend
from moe_overlap.distributed.link import LinkSpec


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
