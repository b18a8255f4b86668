"""vLLM's metric names for what ``/metrics`` also reports under ours: the KV cache's usage
and the prefix cache's counters, read from the engine's counts when scraped."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moe_overlap.engine.loop import EngineLoop
from moe_overlap.engine.speculation import SpeculationStats


class VllmAliases(Collector):
    """vLLM's names for the KV cache's usage and the prefix cache's counters."""

    def __init__(self, engine: EngineLoop):
        self.engine = engine

    def describe(self) -> list:
        return []  # collected when scraped: the engine's counts then

    def collect(self):
        stats = engine_slots(self.engine.stats())
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (0-1)")
        usage.add_metric([], stats["usage"])
        yield usage
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            counter = CounterMetricFamily(f"vllm:{name}", f"Prefix cache {name[13:]}, in tokens")
            counter.add_metric([], stats[name])
            yield counter


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
