"""What the server tells its operators: Prometheus metrics at ``/metrics``, ``/version``, one log
line per finished request, and a throughput line every ``LOG_EVERY_S`` while busy.

Latencies are measured where the server hands tokens to clients: time to first token from the
request's arrival to its first token, inter-token latency between a request's later tokens, and
end-to-end latency from arrival to its last delta. Each server has a registry of its own, so two
servers in one process (tests) do not share counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from moe_overlap.core.overlap_stats import combined, overlap_stats
from moe_overlap.core.step import StepReply
from moe_overlap.engine.expert_distribution import ExpertDistribution
from moe_overlap.engine.loop import Delta, EngineLoop
from moe_overlap.engine.online_eplb import EPLB_GAUGES
from moe_overlap.server.engine_stats import engine_slots
from moe_overlap.server.vllm_metrics import VllmAliases

logger = logging.getLogger("moe_overlap.server")
LOG_EVERY_S = 10.0
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def package_version() -> str:
    try:
        return version("moe_overlap")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH=src)
        return "unknown"


def configure_logging(level: str) -> None:
    """Our loggers at ``level`` (uvicorn's get the same level from its config), to stderr."""
    ours = logging.getLogger("moe_overlap")
    ours.setLevel(level.upper())
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.propagate = False


class ServerMetrics:
    """The server's Prometheus metrics and its log lines."""

    def __init__(self, engine: EngineLoop, overlap_mode: str):
        self.engine = engine
        self.registry = CollectorRegistry()
        self._request_metrics()
        self._engine_gauges(overlap_mode)
        engine.step_listeners.append(self._step_metrics())
        self.expert_rank_load = Gauge(
            "moe_overlap_expert_rank_load",
            "Tokens routed to each EP rank's experts per MoE layer, as of the last "
            "/dump_expert_distribution_record",
            ["layer", "rank"],
            registry=self.registry,
        )
        self.expert_balancedness = Gauge(
            "moe_overlap_expert_balancedness",
            "Mean EP rank load over the largest per MoE layer (1 is even), as of the last dump",
            ["layer"],
            registry=self.registry,
        )
        self.totals = [0, 0]  # prompt and generated tokens so far, for the throughput line
        self._last_log = (time.monotonic(), 0, 0)

    def expert_load(self, distribution: ExpertDistribution) -> None:
        """Set the expert gauges from a read of the recorder."""
        d = distribution
        for layer, ranks, balance in zip(d.layers, d.rank_load, d.balancedness, strict=True):
            self.expert_balancedness.labels(str(layer)).set(balance)
            for rank, tokens in enumerate(ranks):
                self.expert_rank_load.labels(str(layer), str(rank)).set(tokens)

    def _request_metrics(self) -> None:
        """What ``RequestMetrics`` observes: latencies, tokens and finished requests."""
        r = self.registry
        self.ttft, self.itl, self.e2e = (
            Histogram(f"moe_overlap_{name}_seconds", doc, buckets=LATENCY_BUCKETS, registry=r)
            for name, doc in (
                ("time_to_first_token", "Time from a request's arrival to its first token"),
                ("inter_token_latency", "Time between a request's successive tokens"),
                ("e2e_request_latency", "Time from a request's arrival to its last token"),
            )
        )
        self.prompt_tokens = Counter(
            "moe_overlap_prompt_tokens",
            "Prompt tokens prefilled (counted at the first token)",
            registry=r,
        )
        self.generation_tokens = Counter(
            "moe_overlap_generation_tokens", "Tokens generated", registry=r
        )
        self.finished = Counter(
            "moe_overlap_requests_finished",
            "Finished requests by finish reason (eos, stop, length, context, error, aborted)",
            ["finish_reason"],
            registry=r,
        )

    def _engine_gauges(self, overlap_mode: str) -> None:
        """The engine's state, read when scraped: its queues, slots, health and mode."""
        r, engine = self.registry, self.engine
        self._gauge("moe_overlap_requests_running", "Requests in the batch", "running")
        self._gauge("moe_overlap_requests_waiting", "Requests queued for a slot", "waiting")
        self._gauge("moe_overlap_kv_slots_used", "KV cache slots held by requests", "used_slots")
        self._gauge("moe_overlap_kv_slots_total", "KV cache slots on all ranks", "total_slots")
        self._gauge("moe_overlap_kv_pages_used", "KV cache pages held by requests", "used_pages")
        self._gauge("moe_overlap_kv_pages_total", "KV cache pages on all ranks", "total_pages")
        self._gauge(
            "moe_overlap_kv_cache_usage", "Share of the KV cache pages in use (0-1)", "usage"
        )
        self._gauge(
            "moe_overlap_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache since the start",
            "prefix_cache_queries",
        )
        self._gauge(
            "moe_overlap_prefix_cache_hits",
            "Of those, tokens found cached (their prefill skipped)",
            "prefix_cache_hits",
        )
        r.register(VllmAliases(engine))
        for stat, doc in EPLB_GAUGES.items():  # online EPLB's counts
            self._gauge(f"moe_overlap_{stat}", doc, stat)
        self._gauge(
            "moe_overlap_preemptions",
            "Requests preempted (their pages freed, recomputed later) since the start",
            "preemptions",
        )
        for name, doc in (
            ("verifications", "sequences whose drafts a target-verify forward checked"),
            ("draft_tokens", "draft tokens verified"),
            ("accepted_tokens", "draft tokens accepted"),
        ):
            self._gauge(f"moe_overlap_spec_{name}", f"Speculative decoding: {doc}", f"spec_{name}")
        self._gauge(
            "moe_overlap_spec_mean_acceptance_length",
            "Speculative decoding: tokens per verification, the bonus token included (SGLang's "
            "accept length; 0 before any)",
            "spec_acceptance_length",
        )
        up = Gauge(
            "moe_overlap_engine_up", "1 while every rank serves, 0 once one failed", registry=r
        )
        up.set_function(lambda: 0.0 if engine.error else 1.0)
        healthy = Gauge(
            "moe_overlap_ranks_healthy",
            "1 while /health finds every rank serving; 0 when one died, is stopped or is stuck",
            registry=r,
        )
        healthy.set_function(lambda: 0.0 if engine.health() else 1.0)
        Gauge(
            "moe_overlap_overlap_mode_info",
            "The overlap mode the engine runs",
            ["mode"],
            registry=r,
        ).labels(overlap_mode).set(1)

    def _step_metrics(self) -> Callable[[StepReply], None]:
        """The forwards by mode and the communication hidden, fed by every step's reply."""
        r = self.registry
        forwards = Counter(
            "moe_overlap_forwards",
            "Forwards by the overlap scheme each ran, per data-parallel group (under auto: the "
            "mode it chose for that forward; none where a scheme declined the batch)",
            ["mode"],
            registry=r,
        )

        comm, hidden = (
            Counter(f"moe_overlap_{name}_seconds", doc, registry=r)
            for name, doc in (
                ("comm", "Seconds of communication in flight, summed over ranks, in recorded "
                 "steps (--metrics-record-every)"),
                ("comm_hidden", "Of those, seconds during which the rank computed too"),
            )
        )  # fmt: skip
        share = Gauge(
            "moe_overlap_comm_hidden_share",
            "Share of communication hidden behind computation in the last recorded step",
            registry=r,
        )

        def count_modes(reply: StepReply) -> None:
            for group in reply.groups:
                forwards.labels(group.mode).inc()
            if reply.spans and all(s is not None for s in reply.spans):
                stats = combined([overlap_stats(s or []) for s in reply.spans])
                comm.inc(stats.comm_s)
                hidden.inc(stats.hidden_s)
                if stats.hidden_share is not None:
                    share.set(stats.hidden_share)

        return count_modes

    def _gauge(self, name: str, doc: str, stat: str) -> None:
        gauge = Gauge(name, doc, registry=self.registry)
        gauge.set_function(lambda: float(engine_slots(self.engine.stats())[stat]))

    def request(self, name: str) -> RequestMetrics:
        return RequestMetrics(self, name)

    async def log_throughput(self) -> None:
        """While requests run: every LOG_EVERY_S, a line of throughput and load (as vLLM)."""
        while True:
            await asyncio.sleep(LOG_EVERY_S)
            stats = engine_slots(self.engine.stats())
            then, prompt0, gen0 = self._last_log
            now, (prompt, gen) = time.monotonic(), self.totals
            self._last_log = (now, prompt, gen)
            if gen == gen0 and not stats["running"] and not stats["waiting"]:
                continue  # idle: nothing to say
            logger.info(
                "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
                "running %d, waiting %d, KV slots used %d of %d, KV cache usage %.1f%%, "
                "preemptions %d",
                (prompt - prompt0) / (now - then),
                (gen - gen0) / (now - then),
                stats["running"],
                stats["waiting"],
                stats["used_slots"],
                stats["total_slots"],
                100 * stats["usage"],
                stats["preemptions"],
            )


class RequestMetrics:
    """One HTTP call's requests, timed from its arrival."""

    def __init__(self, metrics: ServerMetrics, name: str):
        self.metrics, self.name = metrics, name
        self.arrived = time.monotonic()
        self.last: dict[int, float] = {}  # choice index -> its last token's time
        self.ended: set[int] = set()

    def delta(self, index: int, delta: Delta) -> None:
        now = time.monotonic()
        m = self.metrics
        if delta.token_ids:
            if index in self.last:
                m.itl.observe(now - self.last[index])
            else:  # the prompt has been prefilled: count it now, so throughput shows prefill
                m.ttft.observe(now - self.arrived)
                m.prompt_tokens.inc(delta.prompt_tokens)
                m.totals[0] += delta.prompt_tokens
            self.last[index] = now
            m.generation_tokens.inc(len(delta.token_ids))
            m.totals[1] += len(delta.token_ids)
        reason = delta.finish_reason or ("error" if delta.error else None)
        if reason is not None:
            self.ended.add(index)
            m.e2e.observe(now - self.arrived)
            m.finished.labels(reason).inc()
            logger.info(
                "%s choice %d: %d prompt tokens, %d generated, finish %s, %.3f s%s",
                self.name,
                index,
                delta.prompt_tokens,
                delta.completion_tokens,
                reason,
                now - self.arrived,
                f" ({delta.failed or delta.error})" if (delta.failed or delta.error) else "",
            )

    def close(self, choices: int) -> None:
        """The call ended; choices that never finished were aborted (a client went away)."""
        for index in range(choices):
            if index not in self.ended:
                self.metrics.finished.labels("aborted").inc()
                logger.info("%s choice %d: aborted after %.3f s", self.name, index,
                            time.monotonic() - self.arrived)  # fmt: skip


def install_observability(app: FastAPI, engine: EngineLoop, overlap_mode: str) -> ServerMetrics:
    """Add ``/metrics`` and ``/version`` to ``app``; return the metrics its routes feed."""
    metrics = ServerMetrics(engine, overlap_mode)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_route() -> dict:
        return {"version": package_version()}

    return metrics
