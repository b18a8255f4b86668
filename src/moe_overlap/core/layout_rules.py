"""Which parallel layouts are legal: ``check_layout`` decides every refusal, each a ConfigError
naming the bad value and the fix. The rest of the code computes from a legal layout (the
groups in ``distributed/layout.py``, the dispatcher backend in ``dispatch/factory.py``) and
refuses nothing itself.

The rules are SGLang's where it has them (sizes, a model's divisibility, PD multiplexing), and
ours where a mode needs something of the layout (auto under pipeline stages, DBO or a link on
one rank).
"""

from __future__ import annotations

from moe_overlap.core.a2a_mode import A2AMode, Backend
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES
from moe_overlap.core.parallel_config import ParallelConfig


def check_layout(
    par: ParallelConfig,
    cfg: ModelConfig | None = None,
    overlap: OverlapConfig | None = None,
    link: str | None = None,
    pdmux: bool = False,
    emulate_peers: int = 0,
    redundant: int = 0,
) -> None:
    """Refuse ``par`` if it is not a layout; then, given them, if ``cfg`` (with ``redundant``
    extra expert slots, EPLB's, which need not be valid yet) does not fit it, if
    ``overlap``'s mode or backend needs something it lacks, if ``link`` (the ``--link`` spec
    of an emulated link, None for none) has no link to emulate, or if PD multiplexing
    (``pdmux``) cannot run on it. ``emulate_peers`` N > 0 (``bench --emulate-peers``): one
    process plays rank 0 of ``--ep N``, and the rest is checked on that layout."""
    overlap = overlap or OverlapConfig()
    if emulate_peers:
        par = _check_emulation(par, emulate_peers, cfg, overlap.moe_a2a_backend, link, pdmux)
    _check_sizes(par)
    if cfg is not None:
        _check_model(cfg, par, redundant if is_int(redundant) and redundant > 0 else 0)
    _check_backend(overlap.moe_a2a_backend, par)
    if overlap.a2a_mode == A2AMode.LOW_LATENCY:
        _check_low_latency(par, overlap.moe_a2a_backend, pdmux)
    _check_modes(par, overlap, link)
    if pdmux:
        _check_pdmux(par, overlap, cfg)


def divisors(n: int) -> str:
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def _check_sizes(par: ParallelConfig) -> None:
    tp, ep, dp, pp = par.tp, par.ep, par.dp, par.pp
    if par.pure_ep:
        if pp > 1:
            raise ConfigError(
                f"--pp={pp} with pure expert parallelism (--tp 1 --ep {ep}): pipeline stages "
                f"split a TP world; use --tp {ep} --ep {ep} --pp {pp}"
            )
        if dp not in (1, ep):
            raise ConfigError(
                f"--dp={dp} with pure expert parallelism --ep={ep}: every rank is its own "
                f"attention-DP rank; set --dp=1 or --dp={ep}"
            )
        return
    if tp > 1 and ep > tp:
        raise ConfigError(
            f"--ep={ep} is larger than --tp={tp}: expert parallelism lives inside the TP world; "
            f"set --ep to a divisor of {tp}, or --tp 1 for pure EP"
        )
    if tp % ep:
        raise ConfigError(
            f"--ep={ep} does not divide --tp={tp}; choose ep in {divisors(tp)}"
            + (" (or --tp=1 --pp=1 for pure expert parallelism)" if pp == 1 else "")
        )
    if par.enable_dp_attention and tp % dp:
        raise ConfigError(f"--dp={dp} does not divide --tp={tp}; choose dp in {divisors(tp)}")


def _check_model(cfg: ModelConfig, par: ParallelConfig, redundant: int) -> None:
    """SGLang's refusals for a model on a layout (its experts and ``redundant`` extra slots)."""
    heads, a = cfg.num_attention_heads, par.attn_tp
    where = f"attention TP size {a} (--tp {par.tp} / --dp {par.attn_dp})"
    if heads % a:
        raise ConfigError(
            f"num_attention_heads={heads} is not divisible by the {where}; choose --tp/--dp so "
            f"that tp/dp divides {heads}"
        )
    kv_counts = {cfg.kv_heads(i) for i in range(cfg.num_hidden_layers)}  # MiMo: two
    for kv in sorted(kv_counts) if not cfg.is_deepseek else ():
        if kv % a and a % kv:
            name = (
                "num_key_value_heads"
                if kv == cfg.num_key_value_heads
                else "swa_num_key_value_heads"
            )
            raise ConfigError(
                f"{name}={kv} and the {where}: one must divide the other (KV heads are split, "
                "or replicated when fewer than the attention-TP ranks)"
            )
    if par.pp > cfg.num_hidden_layers:
        raise ConfigError(
            f"--pp={par.pp} is more stages than the model's {cfg.num_hidden_layers} layers; "
            f"set --pp to at most {cfg.num_hidden_layers}"
        )
    if (cfg.num_experts + redundant) % par.ep:
        raise ConfigError(_experts_over_ep(cfg.num_experts, redundant, par.ep))
    if cfg.moe_intermediate_size % par.moe_tp:
        raise ConfigError(
            f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by the moe-TP "
            f"size {par.moe_tp} (--tp {par.tp} / --ep {par.ep}); raise --ep"
        )
    widths = {}
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.n_shared_experts:
        widths["shared experts' width"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    for name, width in widths.items():
        if width % a:
            raise ConfigError(
                f"{name}={width} (dense MLPs run tensor parallel over attention TP) is not "
                f"divisible by the {where}"
            )


def _experts_over_ep(experts: int, redundant: int, ep: int) -> str:
    """Why ``experts`` + ``redundant`` slots do not fit ``ep`` ranks, and the fixes."""
    if not redundant:
        return (
            f"--ep={ep} must divide num_experts={experts}; choose a divisor, or add EPLB's "
            f"redundant experts so that num_experts + --ep-num-redundant-experts divides by {ep}"
        )
    fit = -experts % ep or ep
    return (
        f"--ep={ep} must divide num_experts={experts} + --ep-num-redundant-experts={redundant} "
        f"= {experts + redundant} physical expert slots; choose --ep-num-redundant-experts "
        f"{fit} (or {fit} plus a multiple of {ep}), or an --ep that divides {experts + redundant}"
    )


def _check_backend(backend: str, par: ParallelConfig) -> None:
    """``--moe-a2a-backend``'s explicit choices against the layout (``auto`` always fits)."""
    if par.stage_size == 1:  # every pipeline stage is one process
        if backend in (Backend.TORCH, Backend.NONE):
            raise ConfigError(
                f"--moe-a2a-backend={backend} needs more than one rank per pipeline stage "
                "(--tp or --ep > 1); use local (or auto)"
            )
        return
    if backend == Backend.LOCAL:
        raise ConfigError(
            f"--moe-a2a-backend=local holds every expert on one rank; with {par.describe()} "
            "use torch or none (or auto)"
        )
    if backend == Backend.TORCH and par.moe_tp > 1:
        raise ConfigError(
            f"--moe-a2a-backend=torch needs --ep equal to --tp (whole experts per rank), not "
            f"--ep {par.ep} with --tp {par.tp}; set --ep {par.tp}, or use none (or auto)"
        )


def _check_low_latency(par: ParallelConfig, backend: str, pdmux: bool) -> None:
    """``--a2a-mode low_latency`` runs on the all-to-all dispatcher of whole experts (under
    attention TP each rank sends its share of the group's tokens), with one forward per step
    (``auto`` falls back to normal where it cannot)."""
    why = None
    if par.replica_size == 1:
        why = "expert-parallel ranks to send to (--ep 2 or more, or bench --emulate-peers N)"
    elif backend == Backend.NONE or par.moe_tp > 1:
        why = "the all-to-all dispatcher (--ep equal to --tp), not the tensor-parallel MoE"
    elif par.pp > 1 or pdmux:
        why = "one forward per step (no --pp, no --enable-pdmux)"
    if why is not None:
        raise ConfigError(
            f"--a2a-mode low_latency with {par.describe()} needs {why}; use --a2a-mode auto "
            "or normal"
        )


def _check_modes(par: ParallelConfig, overlap: OverlapConfig, link: str | None) -> None:
    MODES[overlap.mode].refuse(par)
    if par.replica_size == 1 and link is not None:
        raise ConfigError(
            f"--link {link} needs more than one rank (--ep or --tp > 1): one process has no "
            "link to emulate"
        )


def _check_emulation(
    par: ParallelConfig,
    peers: int,
    cfg: ModelConfig | None,
    backend: str,
    link: str | None,
    pdmux: bool,
) -> ParallelConfig:
    """``--emulate-peers``'s refusals; returns the layout the one process emulates."""
    if not is_int(peers) or peers < 2:
        raise ConfigError(
            f"--emulate-peers={peers!r}: emulate an EP group of 2 or more ranks (0: off)"
        )
    flags = {"--ep": par.ep, "--tp": par.tp, "--dp": par.dp, "--pp": par.pp}
    for flag, value in flags.items():
        if value != 1:
            raise ConfigError(
                f"{flag}={value} with --emulate-peers {peers}: emulation runs one process as "
                f"rank 0 of --ep {peers}; drop {flag} (the emulated group is --ep {peers})"
            )
    if par.enable_dp_attention:
        raise ConfigError(
            f"--enable-dp-attention with --emulate-peers {peers}: the emulated rank runs "
            "attention alone (pure EP); drop --enable-dp-attention"
        )
    if cfg is not None and cfg.num_experts % peers:
        raise ConfigError(
            f"--emulate-peers={peers} must divide num_experts={cfg.num_experts} (each rank "
            f"holds num_experts / N); choose N in {divisors(cfg.num_experts)} other than 1"
        )
    if backend not in (Backend.AUTO, Backend.TORCH):
        raise ConfigError(
            f"--moe-a2a-backend={backend} with --emulate-peers {peers}: emulation runs the "
            "all-to-all dispatcher; use torch (or auto)"
        )
    if link is not None and not link.startswith("model:"):
        raise ConfigError(
            f"--link {link} with --emulate-peers {peers}: emulated peers have no network to "
            "shape; use --link model:BANDWIDTH,LATENCY (e.g. model:400mbit,50us) or none"
        )
    if pdmux:
        raise ConfigError(f"--enable-pdmux with --emulate-peers {peers}: drop one")
    return ParallelConfig(ep=peers)


def _check_pdmux(par: ParallelConfig, overlap: OverlapConfig, cfg: ModelConfig | None) -> None:
    """SGLang's refusals for PD multiplexing, and ours (the prefill lane's MoE has its own
    groups, but attention TP would share the model's)."""
    if par.pp > 1:
        raise ConfigError("--enable-pdmux does not combine with --pp (as in SGLang); drop one")
    if not MODES[overlap.mode].with_pdmux:
        allowed = " or ".join(m.name for m in MODES.values() if m.with_pdmux)
        raise ConfigError(
            f"--enable-pdmux does not combine with overlap {overlap.mode} (SGLang refuses "
            f"two-batch overlap with it); use {allowed}"
        )
    if par.attn_tp > 1:
        raise ConfigError(
            f"--enable-pdmux needs attention TP 1, not {par.attn_tp} (--tp {par.tp} / --dp "
            f"{par.attn_dp}): the prefill lane shares the model's attention-TP group; use "
            "--enable-dp-attention with --dp equal to --tp, or pure --ep"
        )
    if cfg is not None and cfg.is_hybrid:  # the prefill lane has no recurrent-state cache
        raise ConfigError(f"--enable-pdmux does not support model_type={cfg.model_type}")
