"""Runs one rank's forward pass: the model's operations over a ForwardBatch.

The overlap scheme is chosen per forward (the benchmark alternates schemes on the same ranks);
each scheme is built once, on first use.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch

from moe_overlap.core import tracks
from moe_overlap.core.a2a_mode import A2AMode, Backend, step_a2a_mode
from moe_overlap.core.batch import ForwardBatch, most_tokens
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.kv_budget import DEFAULT_PAGE_SIZE
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import MODES, NONE
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs, op_inputs
from moe_overlap.core.timeline import Timeline
from moe_overlap.dispatch.factory import dispatch_share, has_low_latency_form, low_latency_form
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.order import CollectiveOrder
from moe_overlap.model.caches import kv_cache_for, state_cache_for
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.loader import model_placement
from moe_overlap.overlap.auto import AutoOverlap
from moe_overlap.overlap.operations import execute_operations
from moe_overlap.overlap.scheme import OverlapScheme
from moe_overlap.overlap.schemes import scheme_class
from moe_overlap.overlap.strategy import build_operations, strategy_for
from moe_overlap.runtime.cuda_graphs import DecodeGraphs
from moe_overlap.runtime.mtp_drafter import MtpDrafter
from moe_overlap.runtime.pipeline import PipelineStage
from moe_overlap.runtime.prefill_lane import PrefillLane

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: MoeForCausalLM,
        dispatcher: Dispatcher,
        num_slots: int,
        max_len: int,
        overlap: OverlapConfig | None = None,
        group: Group | None = None,
        timeline: Timeline | None = None,
        pp_group: Group | None = None,
        prefill_lane: tuple[Dispatcher, CollectiveOrder | None] | None = None,
        cuda_graph_max_bs: int = 0,
        page_size: int = DEFAULT_PAGE_SIZE,
        num_pages: int | None = None,
        mtp_steps: int = 0,
        state_snapshots: int = 0,
        window_pages: int | None = None,
        attention_backend: str = "torch_native",
    ):
        """``pp_group``: this stage's pipeline group under --pp; ``prefill_lane``: PD
        multiplexing's lane dispatcher and the turns its collectives take (None in one
        process); ``cuda_graph_max_bs``: decode batches up to this size replay from CUDA graphs
        where the model and layout allow (0: never); ``num_pages`` of ``page_size`` tokens:
        the KV pool (None: every slot at ``max_len``); ``mtp_steps``: the MTP drafter's
        drafts per sequence after each step (0: none); ``state_snapshots``: recurrent states
        kept at cached page boundaries (hybrid models' prefix caching); ``window_pages``: the
        sliding-window layers' pool where the scheduler counts it (None: as the full one);
        ``attention_backend``: how decode attention reads the pages (``ATTENTION_BACKENDS``)."""
        self.model = model
        self.dispatcher = dispatcher  # the normal dispatch; low-latency ones are built on it
        self.active = dispatcher  # the one this forward's micro-batches use
        # --a2a-mode low_latency runs on the all-to-all dispatcher, one forward per step
        self.low_latency_fits = (
            has_low_latency_form(dispatcher) and pp_group is None and not prefill_lane
        )
        self._low_latency: dict[int, Dispatcher] = {}  # by capacity
        self.group = group or Group.single(name="ep")  # the EP group, for collective decisions
        graphs = self._graphs_fit(cuda_graph_max_bs, pp_group, prefill_lane)
        self.last_hidden: torch.Tensor | None = None  # the last forward's, where kept
        # with graphs, one more slot and page: the padding rows'; with MTP drafts, the MTP
        # layers' entries on the same pages
        drafts = bool(mtp_steps and model.mtp_layers)
        self.kv_cache = kv_cache_for(
            model, num_slots, max_len, page_size, num_pages, int(graphs), window_pages, drafts
        )
        self.kv_cache.read_in_place = attention_backend == "flex_attention"
        # --speculative-algorithm EAGLE: the MTP layers draft after each step, on the last
        # pipeline stage, which holds them
        self.mtp = self._drafter(mtp_steps, cuda_graph_max_bs if graphs else 0)
        self.states = state_cache_for(model, num_slots, state_snapshots)
        self.rollbacks = 0  # slots whose recurrent state the last forward rolled back
        self.ops = build_operations(model, strategy_for(model, NONE.name))
        self.overlap = overlap or OverlapConfig()
        self.timeline = timeline or Timeline()
        self._schemes: dict[OverlapConfig, OverlapScheme] = {}
        # under --pp the stage drives forward_stage; under PD-mux the lane runs prefill waves
        self.pipeline = None if pp_group is None else PipelineStage(self, pp_group)
        self.prefill_lane = None if prefill_lane is None else PrefillLane(self, *prefill_lane)
        self.last_mode = NONE.name  # the scheme the last forward ran (auto: the one it chose)
        self.graphs = self._decode_graphs(cuda_graph_max_bs) if graphs else None

    def _graphs_fit(
        self,
        max_bs: int,
        pp_group: Group | None,
        prefill_lane: tuple[Dispatcher, CollectiveOrder | None] | None,
    ) -> bool:
        """Whether decode replays from CUDA graphs: asked for, and the model and layout allow."""
        device, _ = model_placement(self.model)
        # attention TP's collectives (and the scatter's gather) have not been captured yet
        graphed = self.low_latency_fits and self.share == 1
        why_not = DecodeGraphs.supported(
            self.model, device, self.dispatcher, graphed, pp_group, prefill_lane
        )
        if max_bs > 0 and why_not and device.type == "cuda":
            log.info("decode runs without CUDA graphs: %s", why_not)
        return max_bs > 0 and why_not is None

    def _drafter(self, steps: int, graph_max_bs: int) -> MtpDrafter | None:
        """The MTP drafter over the rank's KV cache, where asked for and the model has MTP
        layers; its steps replay from graphs of their own where the target's do and the
        dispatch is one rank's (the drafter's forwards always take the normal dispatch)."""
        if not (steps and self.model.mtp_layers):
            return None
        local = self.dispatcher.name == Backend.LOCAL
        return MtpDrafter(
            self.model, self.kv_cache, steps, graph_max_bs=graph_max_bs if local else 0
        )

    def _decode_graphs(self, max_bs: int) -> DecodeGraphs:
        return DecodeGraphs(
            self.model,
            self.kv_cache,
            self.forward_stage,
            max_bs,
            mode_ran=lambda: self.last_mode,
            local=self.dispatcher.name == Backend.LOCAL,
        )

    def _scheme(self, cfg: OverlapConfig) -> OverlapScheme:
        key = cfg  # frozen: hashable, and cheaper than a deep astuple per forward
        if key not in self._schemes:
            self._schemes[key] = scheme_class(cfg.mode)(self.model, cfg, self.group)
        return self._schemes[key]

    def choose_dispatch(self, cfg: OverlapConfig, batches: Sequence[ForwardBatch]) -> bool:
        """Set this step's dispatcher from every group's batch (``core/a2a_mode.py``), so every
        rank of the EP group takes the same one; True when it is the low-latency one."""
        cap = cfg.num_max_dispatch_tokens_per_rank
        on_gpu = self.kv_cache.device.type == "cuda"
        rows = functools.partial(self.dispatch_rows, cfg)
        mode = step_a2a_mode(
            cfg.a2a_mode, batches, cap, self.low_latency_fits, on_gpu, rows, self.share
        )
        self.active = self.low_latency(cap) if mode == A2AMode.LOW_LATENCY else self.dispatcher
        return mode == A2AMode.LOW_LATENCY

    def dispatch_rows(self, cfg: OverlapConfig, batches: Sequence[ForwardBatch]) -> int:
        """The most tokens one dispatch carries on any rank when every group runs ``batches``
        in ``cfg``'s mode: its scheme's largest micro-batch, or the whole batch."""
        if MODES[cfg.mode].scheme is None:
            return most_tokens(batches)
        return self._scheme(cfg).largest_dispatch(batches)

    @property
    def share(self) -> int:
        """The attention-TP ranks that cut each dispatch's tokens among them."""
        return dispatch_share(self.dispatcher)

    def low_latency(self, capacity: int) -> Dispatcher:
        if capacity not in self._low_latency:
            self._low_latency[capacity] = low_latency_form(self.dispatcher, capacity)
        return self._low_latency[capacity]

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        overlap: OverlapConfig | None = None,
        peers: list[ForwardBatch] | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` for the rows ``batch.logit_rows()`` names (empty on a
        pipeline stage before the last). ``peers``: every data-parallel group's batch this
        step (this rank's among them), which decides what all ranks must agree on."""
        # the whole batch's starts, before any split: a cut sequence's first piece reads its window
        self.kv_cache.trim_windows(batch.slots, batch.prefix_lens)
        # a verify step's recurrent states rolled back to each sequence's accepted rows: the
        # batch's prefix lengths are the driver's computed lengths, on every stage and rank
        self.rollbacks = self.states.settle(batch.slots, batch.prefix_lens)
        if self.pipeline is not None:
            return self.pipeline.forward(batch, overlap)
        peers = peers or [batch]
        cfg = overlap or self.overlap
        low_latency = self.choose_dispatch(cfg, peers)
        graphs = self.graphs
        if (
            graphs is not None
            and not self.timeline.enabled
            and graphs.covers(peers, cfg, low_latency, functools.partial(self.dispatch_rows, cfg))
        ):
            out = graphs.forward(batch, cfg, peers)
            self.last_mode = graphs.last_mode  # what the captured forward ran
            self.last_hidden = out.hidden
            return out.final_logits()
        return self._logits(batch, cfg)

    def _logits(self, batch: ForwardBatch, cfg: OverlapConfig) -> torch.Tensor:
        return self.forward_stage(batch, cfg).final_logits()

    @torch.inference_mode()
    def forward_stage(
        self,
        batch: ForwardBatch,
        overlap: OverlapConfig | None = None,
        inputs: StageInputs | None = None,
    ) -> ForwardOutputs:
        """This pipeline stage's outputs for ``batch``: the logits on the last stage, else the
        ``hidden_states`` and ``residual`` the next stage starts from (``inputs`` on it)."""
        cfg = overlap or self.overlap
        if MODES[cfg.mode].scheme is not None:
            scheme = self._scheme(cfg)
            out = scheme.forward(batch, self, inputs)
            if out is not None:
                self.last_hidden = out.hidden
                choice = scheme.last_choice if isinstance(scheme, AutoOverlap) else None
                self.last_mode = choice.mode if choice is not None else cfg.mode
                return out
        self.last_mode = NONE.name
        out = ForwardOutputs.of(
            execute_operations(self.context(batch), self.ops, op_inputs(inputs))
        )
        self.last_hidden = out.hidden
        return out

    def forward_plain(self, batch: ForwardBatch) -> torch.Tensor:
        """One batch through every op in order: no overlap, the normal dispatch."""
        self.active = self.dispatcher
        return ForwardOutputs.of(execute_operations(self.context(batch), self.ops)).final_logits()

    def context(self, batch: ForwardBatch, name: str = tracks.FIRST) -> ForwardContext:
        return ForwardContext(
            batch,
            self.kv_cache,
            self.active,
            name=name,
            timeline=self.timeline,
            states=self.states,
        )
