"""One rank's shard of the engine: join the groups, build the model, dispatcher and runner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from moe_overlap.core.device import dist_backend, local_rank, rank_device, torch_dtype
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.parallel_config import ParallelConfig, pp_layers
from moe_overlap.core.step import GroupReply, StepReply, StepRequest
from moe_overlap.core.timeline import Span, Timeline
from moe_overlap.dispatch.emulated import EmulatedAllToAllDispatcher
from moe_overlap.dispatch.factory import make_dispatcher
from moe_overlap.dispatch.fp8_rows import dispatch_rows
from moe_overlap.distributed.emulated import EmulatedGroup
from moe_overlap.distributed.groups import Group, init_process_groups
from moe_overlap.distributed.layout import GROUP_KINDS, ParallelLayout, RankCoords, layout_for
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.distributed.modelled_link import ModelledLink
from moe_overlap.distributed.order import CollectiveOrder
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.loader import build_model
from moe_overlap.model.moe_block import skew_routing
from moe_overlap.model.tensor_parallel import ModelParallel
from moe_overlap.runtime.answer_step import answer_and_draft
from moe_overlap.runtime.model_runner import ModelRunner


@dataclass
class RankSpec:
    """How a rank reaches the others (picklable, sent to each spawned process)."""

    rank: int
    world_size: int
    init_method: str
    timeout_s: float
    link: LinkSpec
    netns: str | None = None  # namespace to enter before any socket exists
    ifname: str | None = None
    threads: int = 1


@dataclass
class RankGroups:
    """The groups a rank joined: its global rank, its groups by kind (``GROUP_KINDS`` and
    ``world``), the link its dispatcher models, and the torch.distributed backend (None in one
    process)."""

    rank: int
    groups: dict[str, Group]
    link: ModelledLink | None
    backend: str | None


def build_rank_runner(
    spec: EngineSpec, rank: RankSpec | None = None, link_spec: LinkSpec | None = None
) -> ModelRunner:
    """This rank's ModelRunner over its shard of the layout; ``rank=None`` is the one-process
    engine (no torch.distributed at all), or under ``spec.emulate_peers`` N rank 0 of ep=N
    with emulated peers over ``link_spec`` (``dispatch/emulated.py``)."""
    device = rank_device(spec.device, 0 if rank is None else local_rank(rank.rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL: each rank's communicator on its own GPU
    if rank is None:
        joined = one_process_groups(spec.emulate_peers, device, link_spec)
    else:
        joined = join_groups(spec, rank)
    return assemble_rank(spec, joined, device)


def rank_parallel(spec: EngineSpec) -> ParallelConfig:
    """The layout this rank's shard is cut from: ep=N for N emulated peers."""
    return ParallelConfig(ep=spec.emulate_peers) if spec.emulate_peers else spec.parallel


def one_process_groups(peers: int, device: torch.device, link_spec: LinkSpec | None) -> RankGroups:
    """One process's groups, each of itself alone; with ``peers`` N its EP group emulates
    rank 0 of N over the modelled link of ``link_spec``, if any."""
    groups = {kind: Group.single(name=kind) for kind in (*GROUP_KINDS, "world")}
    link = None
    if peers:
        groups["ep"] = EmulatedGroup(peers, device)
        if link_spec is not None and link_spec.kind == "model":
            link = ModelledLink.from_spec(link_spec)
    return RankGroups(0, groups, link, None)


def join_groups(spec: EngineSpec, rank: RankSpec) -> RankGroups:
    """Join the launch's torch.distributed world (unless the launcher did) and this rank's
    groups of the layout."""
    par = rank_parallel(spec)
    if rank.world_size != par.world_size:
        raise ConfigError(
            f"{rank.world_size} ranks were started but {par.describe()} needs {par.world_size}"
        )
    backend = dist_backend(spec.device)  # the one place the backend is chosen
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=rank.init_method,
            rank=rank.rank,
            world_size=rank.world_size,
            timeout=timedelta(seconds=rank.timeout_s),
        )
    groups = init_process_groups(layout_for(par), rank.rank, backend)
    link = ModelledLink.from_spec(rank.link) if rank.link.kind == "model" else None
    return RankGroups(rank.rank, groups, link, backend)


def assemble_rank(spec: EngineSpec, joined: RankGroups, device: torch.device) -> ModelRunner:
    """The rank's model shard on ``device``, its dispatcher (and PD multiplexing's lane) over
    the groups it ``joined``, and the ModelRunner over them. ``tools/device_ops.py`` assembles
    one process on ``meta`` here."""
    par = rank_parallel(spec)
    layout = layout_for(par)
    coords = layout.coords(joined.rank)
    groups = joined.groups
    model = rank_model(spec, layout, coords, groups["attn_tp"], device)
    timeline = Timeline()
    groups["attn_tp"].timeline = timeline  # attention/vocabulary all-reduces and all-gathers
    dispatcher = rank_dispatcher(spec, groups, coords, joined.link, timeline)
    # every rank that shares a MoE collective takes the overlap decisions together
    moe_group = groups["ep"] if layout.pure_ep else groups["tp"]
    return ModelRunner(
        model,
        dispatcher,
        spec.num_slots,
        spec.max_len,
        spec.overlap,
        moe_group,
        timeline,
        pp_group=groups["pp"] if par.pp > 1 else None,
        prefill_lane=prefill_lane(spec, joined, coords, timeline) if spec.pdmux_splits else None,
        cuda_graph_max_bs=spec.cuda_graph_max_bs,
        page_size=spec.page_size,
        attention_backend=spec.attention_backend,
        num_pages=spec.pool_pages,
        mtp_steps=spec.mtp_steps,
        state_snapshots=spec.state_snapshots,
        window_pages=None if spec.window_budget is None else spec.window_budget[1],
    )


def rank_model(
    spec: EngineSpec,
    layout: ParallelLayout,
    coords: RankCoords,
    attn_tp: Group,
    device: torch.device,
) -> MoeForCausalLM:
    """This rank's shard of the model: its attention-TP share, experts and pipeline stage."""
    model_par = ModelParallel(
        attn_tp,
        coords.ep_rank,
        layout.ep,
        coords.moe_tp_rank,
        layout.moe_tp,
        pp_layers(spec.config.num_hidden_layers, coords.pp_rank, rank_parallel(spec).pp),
        spec.placement,
    )
    path = Path(spec.model_path) if spec.model_path else None
    dtype = torch_dtype(spec.dtype)
    # one bar for the whole engine: global rank 0's (every rank reads its own share)
    rank0, mtp = coords.rank == 0, spec.mtp_steps > 0
    model = build_model(
        spec.config, path, spec.seed, model_par, device, dtype, rank0,
        fp8_on_the_fly=spec.fp8_on_the_fly, mtp=mtp,
    )  # fmt: skip
    if spec.expert_skew:
        skew_routing(model, spec.expert_skew, spec.seed)
    return model


def rank_dispatcher(
    spec: EngineSpec,
    groups: dict[str, Group],
    coords: RankCoords,
    link: ModelledLink | None,
    timeline: Timeline,
) -> Dispatcher:
    """The MoE dispatcher over ``groups``: ``--moe-a2a-backend``'s for the layout, or the
    emulated all-to-all where the EP group's peers are emulated."""
    ep = groups["ep"]
    # the dispatchers route to physical slots: E, or E + redundant ones under EPLB
    experts = spec.placement.num_slots if spec.placement else spec.config.num_experts
    wire = dispatch_rows(
        spec.overlap.moe_dispatch_dtype, spec.config.hidden_size, torch_dtype(spec.dtype)
    )
    if isinstance(ep, EmulatedGroup):
        return EmulatedAllToAllDispatcher(ep, experts, link, timeline, wire)
    backend, par = spec.overlap.moe_a2a_backend, rank_parallel(spec)
    return make_dispatcher(backend, experts, par, groups, coords, link, timeline, wire)


def prefill_lane(
    spec: EngineSpec, joined: RankGroups, coords: RankCoords, timeline: Timeline
) -> tuple[Dispatcher, CollectiveOrder | None]:
    """PD multiplexing's lane: a dispatcher whose MoE collectives run on process groups of
    their own and, across processes, the one order in which every rank launches both lanes'
    collectives (two threads launch them). One process shares its groups and needs no order."""
    if joined.backend is None:
        return rank_dispatcher(spec, joined.groups, coords, joined.link, timeline), None
    lane_groups = init_process_groups(layout_for(rank_parallel(spec)), joined.rank, joined.backend)
    dispatcher = rank_dispatcher(spec, lane_groups, coords, joined.link, timeline)
    order = CollectiveOrder()
    for name, of_lane in (("decode", joined.groups), ("prefill", lane_groups)):
        for group in of_lane.values():
            group.order, group.lane = order, name
    return dispatcher, order


def serve_step(
    runner: ModelRunner, request: StepRequest, group: int, answers: bool
) -> tuple[GroupReply | None, list[Span] | None, GroupReply | None]:
    """One forward of data-parallel ``group``'s batch, and beside it, under PD multiplexing,
    a range of the prefill wave's layers on the prefill lane. A rank that ``answers`` for its
    group returns the group's reply (sampled tokens, or logits), and after the wave's last
    range the wave's; every rank returns its timeline's spans when the step is recorded."""
    runner.timeline.enabled = request.record
    batch, wave = request.batches[group], request.prefill
    if request.pages is not None:  # before this step's sequences take pages
        runner.kv_cache.apply(request.pages[group])
        runner.states.apply_snapshots(request.pages[group])
    running, lane = None, runner.prefill_lane
    if wave is not None:
        if lane is None:
            raise RuntimeError("a prefill wave reached a rank without --enable-pdmux's lane")
        running = lane.start(wave.batches[group], wave.layers, wave.wave)
    try:
        logits = runner.forward(batch, request.overlap, peers=request.batches)
    finally:
        if lane is not None and running is not None:
            lane.decode_done()  # the lane's collectives stop taking turns
    mode = runner.last_mode
    wave_logits = lane.finish(running) if lane is not None and running is not None else None
    samples = request.group_samples(group)
    reply = answer_and_draft(runner, batch, logits, runner.last_hidden, samples, mode, answers)
    if reply is not None:
        reply.rollbacks = runner.rollbacks
    wave_reply = None
    if wave is not None and lane is not None and wave_logits is not None:  # the wave's last range
        samples = None if wave.samples is None else wave.samples[group]
        wave_batch, hidden = wave.batches[group], lane.hidden
        wave_reply = answer_and_draft(
            runner, wave_batch, wave_logits, hidden, samples, NONE.name, answers
        )
    spans = runner.timeline.take() if request.record else None
    if reply is None:
        return None, spans, None
    return reply, spans, wave_reply


def gather_replies(
    par, replies: list[tuple[GroupReply | None, list[Span] | None, GroupReply | None]]
) -> StepReply:
    """The step's reply from every rank's ``serve_step`` result, in rank order: one rank of
    each group (attention-TP rank 0 of its last stage) answers for it."""
    answers = [reply for r, reply in enumerate(replies) if par.answers(r)]
    groups = [group for group, _, _ in answers]
    assert all(g is not None for g in groups), "an answering rank sent no reply"
    waves = [wave for _, _, wave in answers]
    return StepReply(
        [g for g in groups if g is not None],
        [spans for _, spans, _ in replies],
        None if any(w is None for w in waves) else [w for w in waves if w is not None],
    )


def probe_all_to_all(
    group: Group, num_bytes: int, repeats: int, p2p: bool | None, link: ModelledLink | None
) -> list[float]:
    """Seconds of each of ``repeats`` all-to-alls sending ``num_bytes`` from this rank, spread
    evenly over the ranks (the share to itself never crosses the link)."""
    rows = max(group.size, num_bytes // 4 // 1024 // group.size * group.size)
    x = torch.zeros(rows, 1024, device=group.device)
    splits = [rows // group.size] * group.size
    times = []
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        group.all_to_all(x, splits, splits, p2p=p2p)
        if x.is_cuda:  # the wait above only ordered the stream
            torch.cuda.synchronize(x.device)
        if link is not None:  # the dispatcher's link model: queued, latency + bytes / rate
            link.sleep_until(link.reserve(start, x.numel() * 4 * (group.size - 1) // group.size))
        times.append(time.perf_counter() - start)
    return times
