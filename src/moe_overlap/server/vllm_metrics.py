"""vLLM's metric names for what ``/metrics`` also reports under ours: the KV cache's usage
and the prefix cache's counters, read from the engine's counts when scraped."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moe_overlap.engine.loop import EngineLoop
from moe_overlap.server.engine_stats import engine_slots


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
