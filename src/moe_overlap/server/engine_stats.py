"""The engine's counts as ``/metrics`` reads them: ``EngineLoop.stats()`` with what follows
from them (slots and pages in use, the pool's share in use, speculative decoding's mean
acceptance length), for our gauges and vLLM's aliases alike."""

from __future__ import annotations

from moe_overlap.engine.speculation import SpeculationStats


def engine_slots(stats: dict[str, int]) -> dict[str, float]:
    """The engine's stats with what is used, the pages' share in use and speculative
    decoding's mean acceptance length."""
    used_pages = stats["total_pages"] - stats["free_pages"]
    return {
        **stats,
        "used_slots": stats["total_slots"] - stats["free_slots"],
        "used_pages": used_pages,
        "usage": used_pages / max(stats["total_pages"], 1),
        "spec_acceptance_length": SpeculationStats(
            stats["spec_verifications"], stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
        ).mean_acceptance_length,
    }
