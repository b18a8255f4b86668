"""Speculative decoding on the planner: a decode step against a draft-then-verify step.

A verify forward carries ``K`` rows per sequence (the last token and ``K - 1`` drafts), so its
batch has ``K`` times the tokens of the decode step it replaces: the same engine decisions (the
TBO vote takes it as decode and cuts it by whole sequences) and op costs as any batch, timed by
the planner. The drafter runs before it, never split: n-gram lookup costs nothing on the GPU;
an MTP drafter runs one decoder layer and the LM head per draft, ``K - 1`` times. A step gives
``A`` tokens per sequence (the accept length, the bonus token included), so speculative
decoding's tokens/s is ``A`` sequences' worth per draft-and-verify time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from rich.table import Table

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError, is_finite_number, is_int
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE, Runs
from moe_overlap.core.workloads import DEFAULT_WORKLOAD
from moe_overlap.planner.inputs import PlanLayout
from moe_overlap.planner.plan import ModePlan, Planner

DRAFTERS = ("ngram", "mtp")  # what a draft costs: nothing on the GPU, or an MTP layer a draft
SPEC_WORKLOAD = "decode:64:4096"  # planned when --workload is left at its (prefill) default
PAYS = 0.97  # overlap pays where it takes at most this share of none's time (as `recommend`)


@dataclass(frozen=True)
class Speculation:
    rows: int  # K: rows per sequence in a verify forward (SGLang's num_draft_tokens)
    accept_length: float  # A: tokens a verification gives, the bonus included
    drafter: str

    @property
    def drafts(self) -> int:
        return self.rows - 1


def speculation_inputs(rows: int | None, accept: float | None, drafter: str) -> Speculation | None:
    """The flags' speculation (None: plan plain decoding alone); a bad value is refused."""
    if rows is None:
        if accept is not None:
            raise ConfigError(
                f"--accept-length={accept} needs --speculative-num-draft-tokens K, the rows per "
                "sequence of the verify forward"
            )
        return None
    if not is_int(rows) or rows < 2:
        raise ConfigError(
            f"--speculative-num-draft-tokens={rows!r} must be an integer >= 2 (the last token "
            "and at least one draft)"
        )
    if accept is None:
        raise ConfigError(
            f"--speculative-num-draft-tokens={rows} needs --accept-length A: tokens per "
            "verification, the bonus included (1 to K; /metrics and SGLang's logs report it)"
        )
    if not is_finite_number(accept) or not 1 <= accept <= rows:
        raise ConfigError(f"--accept-length={accept!r} must be between 1 and K={rows}")
    if drafter not in DRAFTERS:
        raise ConfigError(f"--speculative-drafter={drafter!r} must be one of {DRAFTERS}")
    return Speculation(rows, float(accept), drafter)


def speculative_workload(workload: str, speculating: bool) -> tuple[str, str | None]:
    """The workload to plan, and a note where speculation changed it: a verify step replaces
    a decode step, so it needs a decode workload (``decode:BS:CTX``)."""
    if not speculating or workload.startswith("decode:"):
        return workload, None
    if workload == DEFAULT_WORKLOAD:
        return SPEC_WORKLOAD, f"speculation replaces decode steps: workload {SPEC_WORKLOAD}"
    raise ConfigError(
        f"--workload {workload!r} is not a decode workload; speculative decoding replaces "
        "decode steps: give --workload decode:BS:CTX"
    )


def verify_batch(batch: ForwardBatch, rows: int) -> ForwardBatch:
    """``batch``'s decode sequences as a target-verify batch of ``rows`` rows each."""
    n = batch.num_seqs
    return ForwardBatch(
        torch.zeros(n * rows, dtype=torch.long),
        list(batch.slots),
        list(batch.prefix_lens),
        [rows] * n,
        [True] * n,
        [True] * n,
    )


@dataclass(frozen=True)
class SpecPlan:
    """One mode's decode step against its draft-and-verify step."""

    decode: ModePlan
    verify: ModePlan
    draft_s: float
    seqs: int  # decoding sequences over every DP group
    accept_length: float

    @property
    def plain_tokens_per_s(self) -> float:
        return self.seqs / self.decode.seconds

    @property
    def spec_tokens_per_s(self) -> float:
        return self.seqs * self.accept_length / (self.draft_s + self.verify.seconds)


def plan_speculation(
    planner: Planner,
    configs: dict[str, OverlapConfig],
    batches: list[ForwardBatch],
    layout: PlanLayout,
    spec: Speculation,
) -> dict[str, SpecPlan]:
    """Each mode's plain decode step and its speculative step on rank r's ``batches[r]``."""
    verify = [verify_batch(b, spec.rows) for b in batches]
    draft_s = spec.drafts * draft_step_seconds(planner, batches) if spec.drafter == "mtp" else 0.0
    seqs = sum(batches[g * layout.attn_tp].num_seqs for g in range(layout.dp_groups))
    return {
        mode: SpecPlan(
            planner.plan(mode, cfg, batches),
            planner.plan(mode, cfg, verify),
            draft_s,
            seqs,
            spec.accept_length,
        )
        for mode, cfg in configs.items()
    }


def draft_step_seconds(planner: Planner, batches: list[ForwardBatch]) -> float:
    """One MTP draft step: a decoder layer like the MTP layer and the LM head over each
    sequence's one token, without overlap (the draft forward is never split)."""
    one = dataclasses.replace(planner.spec, cfg=one_layer(planner.spec.cfg))
    return (
        Planner(one, planner.cluster, planner.layout)
        .plan(NONE.name, mode_config(NONE.name), batches)
        .seconds
    )


def one_layer(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with one layer like its MTP layer's: full attention with the MoE, or
    (MiMo-V2-Flash) a sliding-window layer with a dense MLP."""
    kind = "sliding_attention" if cfg.is_mimo else "full_attention"
    return dataclasses.replace(
        cfg,
        num_hidden_layers=1,
        first_k_dense_replace=0,
        mlp_only_layers=[0] if cfg.is_mimo else [],
        decoder_sparse_step=1,
        layer_types=[kind] if cfg.layer_types else [],
    )


def speculation_table(plans: dict[str, SpecPlan], spec: Speculation, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("mode", no_wrap=True)
    columns = ("decode ms", "tokens/s", "draft ms", "verify ms", "spec tokens/s", "speed-up")
    for name in columns:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("verify note")
    for mode, p in plans.items():
        table.add_row(
            mode,
            f"{p.decode.seconds * 1e3:.2f}",
            f"{p.plain_tokens_per_s:,.0f}",
            f"{p.draft_s * 1e3:.2f}",
            f"{p.verify.seconds * 1e3:.2f}",
            f"{p.spec_tokens_per_s:,.0f}",
            f"{p.spec_tokens_per_s / p.plain_tokens_per_s:.2f}x",
            p.verify.note,
        )
    table.caption = (
        f"predicted, not measured: K={spec.rows} rows per sequence ({spec.drafts} drafts), "
        f"accept length A={spec.accept_length:g}, {spec.drafter} drafts; speed-up: the mode's "
        "speculative tokens/s over its plain decode"
    )
    table.caption_justify = "left"
    return table


def speculation_verdict(plans: dict[str, SpecPlan]) -> list[str]:
    """The predicted speed-up (best against best) and whether TBO pays on the verify forward,
    beside whether it pays on plain decode."""
    plain = max(plans, key=lambda m: plans[m].plain_tokens_per_s)
    spec = max(plans, key=lambda m: plans[m].spec_tokens_per_s)
    best, base = plans[spec].spec_tokens_per_s, plans[plain].plain_tokens_per_s
    lines = [
        f"speculative decoding: {best:,.0f} tokens/s ({spec}) against plain decoding's "
        f"{base:,.0f} ({plain}): {best / base:.2f}x predicted"
    ]
    none = plans.get(NONE.name)
    for mode in (m for m in plans if none and MODES[mode_config(m).mode].runs is Runs.SPLIT):
        assert none is not None
        on_verify = none.verify.seconds / plans[mode].verify.seconds
        on_decode = none.decode.seconds / plans[mode].decode.seconds
        verdict = "pays" if 1 / on_verify <= PAYS else "does not pay"
        lines.append(
            f"{mode} on the verify forward: {on_verify:.2f}x over none, {verdict} "
            f"(on plain decode: {on_decode:.2f}x)"
        )
    return lines
