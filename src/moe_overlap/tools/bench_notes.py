"""What a bench figure did not measure: a mode whose recorded forward ran a micro-batch with no
rows, or ran without overlap.

Read off the recorded step: the mode each group's forward ran (``GroupReply.mode``) and each
rank's timeline, where a scheme marks how it cut the forward (``split``) and why it fell back
to no overlap (``decision``).
"""

from __future__ import annotations

from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE, TBO
from moe_overlap.core.step import StepReply
from moe_overlap.core.timeline import Span, split_rows
from moe_overlap.core.tracks import DECISION, is_pipeline

SEQUENCE_SPLIT_HINT = "one sequence cannot be split by sequence; use tbo+two-chunk"


def mode_notes(cfg: OverlapConfig, reply: StepReply) -> list[str]:
    """Why the figure of a mode (run as ``cfg``, recorded in ``reply``) measures less than the
    mode's name says; [] when it ran as named."""
    if cfg.mode == NONE.name:
        return []
    notes = _fallbacks(reply)
    empty = _empty_micro_batches(reply)
    if empty:
        hint = f" ({SEQUENCE_SPLIT_HINT})" if _splits_by_sequence(cfg) else ""
        notes.append(f"{_where(empty)}{hint}")
    return notes


def _fallbacks(reply: StepReply) -> list[str]:
    """No overlap where the mode asked for it, with the reason the ranks recorded (a scheme's
    agreement that fell back, or auto's choice)."""
    if all(g.mode != NONE.name for g in reply.groups):
        return []
    reasons = sorted(
        {_reason(s, spans) for spans in reply.spans if spans for s in spans if s.track == DECISION}
    )
    why = f" ({'; '.join(reasons)})" if reasons else ""
    return [f"ran without overlap{why}"]


def _reason(decision: Span, spans: list[Span]) -> str:
    """A fallback's reason, under --pp with the pipeline micro-batch it fell back in (each
    decides for itself: one may hold a sequence, the next none)."""
    for s in spans:
        if is_pipeline(s.track) and s.start <= decision.start <= s.end:
            return f"{s.track}: {decision.name}"
    return decision.name


def _empty_micro_batches(reply: StepReply) -> dict[int, list[int]]:
    """Per micro-batch that had no rows, the ranks where it had none though the rank had rows."""
    found: dict[int, list[int]] = {}
    for rank, spans in enumerate(reply.spans):
        rows = split_rows(spans or [])
        if sum(rows) > 0:
            for mb in (i for i, n in enumerate(rows) if n == 0):
                found.setdefault(mb, []).append(rank)
    return found


def _where(empty: dict[int, list[int]]) -> str:
    """``micro-batch 0 empty on ranks 0, 1``, one clause per micro-batch."""
    return "; ".join(
        f"micro-batch {mb} empty on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
        for mb, r in sorted(empty.items())
    )


def _splits_by_sequence(cfg: OverlapConfig) -> bool:
    """Plain ``tbo``: two micro-batches cut only between whole sequences."""
    two = cfg.mode == TBO.name and cfg.num_micro_batches == 2
    return two and not cfg.tbo_token_distribution_threshold
