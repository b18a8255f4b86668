"""Simulated operations on a simulated clock, run by the engine's own schedules.

``SimModel`` satisfies ``overlap/strategy.py: StagedModel``, the protocol the strategy builder
reads (the type checker holds it to it), so the strategy table builds the same op lists as for
the real model, and ``overlap/operations.py: execute_overlapped`` (the stage executor) runs
them. An op does no
arithmetic: it advances every rank's clock by its cost. Ranks run the same schedule (the
engine's agreement makes sure of that), so one run moves all ranks at once, each with its own
batch; an all-to-all completes when its bytes have crossed the rank's link (transfers queued
behind what is already on it) and every rank has launched it.

Each rank also has a host clock: one thread launches every device operation in program order
(``Cluster.host_launch_us`` each), and a device op starts no sooner than its launch. A dispatch's
read of the counts drains the device (the host waits for it) before the ranks meet; with no
host cost this is the device-side meet alone, and the plan is the stage order's bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moe_overlap.core import tracks
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.timeline import Span
from moe_overlap.model.decoder import DENSE_OPS, MOE_OPS
from moe_overlap.overlap.operations import Op, Yield
from moe_overlap.overlap.sbo import experts_then_combine
from moe_overlap.overlap.strategy import SchemeOp
from moe_overlap.planner.costs import CostModel, MicroBatchCost


class RankClocks:
    """Every rank's compute clock and link, and (if recording) their spans."""

    def __init__(self, ranks: int, costs: CostModel, record: bool):
        self.costs, self.record = costs, record
        self.share = [0.0] * ranks  # the SM share of the kernel last put on each rank's link
        self.now = [0.0] * ranks  # when each rank's device is done with what it was given
        self.host = [0.0] * ranks  # when each rank's host has launched everything so far
        self.link_free = [0.0] * ranks
        self.compute_s = [0.0] * ranks
        self.comm_s = [0.0] * ranks  # time with some all-to-all in flight
        self._comm_until = [0.0] * ranks
        self.spans: list[list[Span]] = [[] for _ in range(ranks)]

    def compute(self, track: str, label: str, seconds: list[float], launch_s: float = 0.0) -> None:
        """Each rank's device runs an op of ``seconds[r]`` once its host has launched it
        (``launch_s`` of host time, after everything launched before)."""
        now, host, shares = self.now, self.host, self.share  # a plan's hottest loop
        for r, s in enumerate(seconds):
            launched = host[r] = host[r] + launch_s
            start = now[r] if now[r] >= launched else launched
            share = shares[r]
            if share and (busy := self.link_free[r] - start) > 0:  # an all-to-all in flight
                slow = s / (1 - share)  # takes some of the GPU
                s = slow if slow <= busy else busy + s - busy * (1 - share)
            now[r] = start + s
            self.compute_s[r] += s
            if self.record:
                self._span(r, track, label, start)

    def _span(self, r: int, track: str, label: str, start: float) -> None:
        spans = self.spans[r]
        if spans and spans[-1].track == track and spans[-1].end == start:
            spans[-1].end = self.now[r]  # one bar per uninterrupted run of a micro-batch's ops
        else:
            spans.append(Span(track, label, start, self.now[r]))

    def barrier(self, extra: float = 0.0) -> None:
        """A collective on the devices: every rank's device waits for the last to reach it."""
        at = max(max(n, h) for n, h in zip(self.now, self.host, strict=True)) + extra
        self.now = [at] * len(self.now)

    def host_meet(self, extra: float = 0.0) -> None:
        """A collective the hosts wait for after reading the device (the counts exchange, the
        agreement): each host drains its device, then all meet; nothing is queued after."""
        at = max(max(n, h) for n, h in zip(self.now, self.host, strict=True)) + extra
        self.now, self.host = [at] * len(self.now), [at] * len(self.host)

    def launch(self, label: str, cost: MicroBatchCost, kind: str, part: float = 1.0) -> list[float]:
        """Start ``part`` of a micro-batch's ``kind`` all-to-all on every rank now; each
        rank's completion time. Its bytes cross the links, or with the low-latency kernels
        (``cost.link_s``) take the seconds those kernels need."""
        self.host = [h + cost.host_launch_s for h in self.host]
        ready = [max(n, h) for n, h in zip(self.now, self.host, strict=True)]
        last_launch = max(ready)
        latency = cost.latency_s
        done = []
        for r, rank_bytes in enumerate(cost.bytes_of(kind)):
            b = [x * part for x in rank_bytes]
            begin = max(ready[r], self.link_free[r])
            ll = cost.link_s.get(kind)
            self.link_free[r] = begin + (ll[r] * part if ll else self.costs.link_seconds(b))
            self.share[r] = cost.sm_share
            end = max(self.link_free[r] + latency, last_launch + latency)
            done.append(end)
            self.comm_s[r] += max(0.0, end - max(ready[r], self._comm_until[r]))
            self._comm_until[r] = max(self._comm_until[r], end)
            if self.record:
                mb = sum(b) / 1e6
                self.spans[r].append(Span(tracks.COMM, f"{label} {mb:.2f} MB", ready[r], end))
        return done

    def wait(self, track: str, done: list[float]) -> None:
        for r, t in enumerate(done):
            if t > self.now[r]:
                if self.record:
                    self.spans[r].append(Span(tracks.wait(track), "wait", self.now[r], t))
                self.now[r] = t


@dataclass
class SimContext:
    """One micro-batch: its name (track), its costs on every rank, its in-flight transfers."""

    name: str
    clocks: RankClocks
    cost: MicroBatchCost
    pending: dict[str, list[float]] = field(default_factory=dict)
    timeline: None = None  # the stage executor records real time only when a timeline is set

    def run(self, label: str, op: str, share: float = 1.0, extra_call: bool = False) -> None:
        """Run op ``op``, or ``share`` of its work as a call of its own: the call pays the op's
        fixed cost whole, or with ``extra_call`` (a call the unsplit op does not make) the
        fixed cost of an op beyond the first micro-batch."""
        seconds = self.cost.seconds[op]
        if share != 1 or extra_call:
            fixed = self.cost.op_overhead_s
            call = self.clocks.costs.op_overhead(self.cost.decode) if extra_call else fixed
            seconds = [(s - fixed) * share + call for s in seconds]
        launches = 0 if op == "switch" else self.clocks.costs.cluster.launches_per_op
        self.clocks.compute(self.name, label, seconds, launches * self.cost.host_launch_s)


SimOp = Callable[..., None]


def _compute(layer_id: int, name: str) -> SimOp:
    label = f"layer {layer_id} {name}"

    def op(ctx: SimContext, **_: object) -> None:
        ctx.run(label, name)

    return op


def _attn_core(layer_id: int) -> SimOp:
    def op(ctx: SimContext, **_: object) -> None:
        ctx.run(f"layer {layer_id} attn_core", "attn_core")
        if any(ctx.cost.allreduce_s):  # attention TP's all-reduce: blocking, all ranks meet
            ctx.clocks.barrier()
            label = f"layer {layer_id} all-reduce"
            ctx.clocks.compute(ctx.name, label, ctx.cost.allreduce_s, ctx.cost.host_launch_s)

    return op


def _send(layer_id: int, kind: str) -> SimOp:
    def op(ctx: SimContext, **_: object) -> None:
        ctx.run(f"layer {layer_id} {kind}_a", f"{kind}_a")
        if kind == "dispatch" and ctx.cost.link_s:  # low-latency kernels: no host read
            ctx.clocks.barrier()
        elif kind == "dispatch":  # the host reads the counts, then all ranks exchange them
            ctx.clocks.host_meet()
        label = f"layer {layer_id} {kind} ({ctx.name})"
        ctx.pending[kind] = ctx.clocks.launch(label, ctx.cost, kind)

    return op


def _receive(layer_id: int, kind: str) -> SimOp:
    def op(ctx: SimContext, **_: object) -> None:
        ctx.clocks.wait(ctx.name, ctx.pending.pop(kind))
        ctx.run(f"layer {layer_id} {kind}_b", f"{kind}_b")

    return op


def sim_experts_then_combine(blocks: int) -> Callable[[SimLayer], SimOp]:
    """SBO's ``experts_combine_a``, run by the engine's own block loop: each block of experts,
    then its combine piece at once; the combine is done when its last piece arrives."""

    def make(layer: SimLayer) -> SimOp:
        def op(ctx: SimContext, **_: object) -> None:
            name, sent = f"layer {layer.layer_id}", []

            def run_block(b: int) -> None:  # the blocks after the first make calls of their own
                ctx.run(f"{name} experts {b}/{blocks}", "experts", 1 / blocks, b > 0)
                ctx.run(f"{name} combine_a {b}", "combine_a", 1 / blocks, b > 0)

            def send_piece(b: int) -> None:
                label = f"{name} combine piece {b}"
                sent.append(ctx.clocks.launch(label, ctx.cost, "combine", 1 / blocks))

            experts_then_combine(blocks, run_block, send_piece)
            ctx.pending["combine"] = [max(ends) for ends in zip(*sent, strict=True)]

        return op

    return make


def sbo_sim_ops(blocks: int) -> dict[str, SchemeOp[SimLayer]]:
    """The simulated twin of ``overlap/sbo.py: sbo_ops`` (the same names and coverage)."""
    return {
        "experts_combine_a": SchemeOp(("experts", "combine_a"), sim_experts_then_combine(blocks)),
    }


def with_switches(ops: list[Op | Yield]) -> list[Op | Yield]:
    """DBO's op list with the hand-over to the other baton thread charged after each yield."""
    switch = _compute(-1, "switch")
    out: list[Op | Yield] = []
    for op in ops:
        out.append(op)
        if isinstance(op, Yield):
            out.append(switch)
    return out


class SimLayer:
    def __init__(self, cfg: ModelConfig, layer_id: int):
        self.layer_id = layer_id
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.op_names: tuple[str, ...]
        if not self.is_moe:
            self.op_names = DENSE_OPS
        elif cfg.n_shared_experts or cfg.shared_expert_intermediate_size:
            self.op_names = MOE_OPS
        else:
            self.op_names = tuple(n for n in MOE_OPS if n != "shared_experts")

    def op(self, name: str) -> SimOp:
        if name not in self.op_names:
            raise KeyError(f"layer {self.layer_id} has no operation {name!r}")
        if name == "attn_core":
            return _attn_core(self.layer_id)
        if name in ("dispatch_a", "combine_a"):
            return _send(self.layer_id, name[:-2])
        if name in ("dispatch_b", "combine_b"):
            return _receive(self.layer_id, name[:-2])
        return _compute(self.layer_id, name)


class SimModel:
    """What the strategy builder reads of a model, with simulated ops."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.layers = [SimLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.op_embed = _compute(-1, "embed")
        self.op_logits = _compute(cfg.num_hidden_layers, "logits")
