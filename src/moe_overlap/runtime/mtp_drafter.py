"""The MTP drafter on the rank (``--speculative-algorithm EAGLE``): after the target's forward
and its answer, the model's MTP layers draft each sequence's next tokens, which go back to
the driver with the sampled ones (``GroupReply.drafts``) and come back in the next verify step.

Per step every rank of the last pipeline stage (which holds the MTP layers) runs the same
forwards (the MTP layer's MoE dispatches like any layer's, so an empty batch still joins): one
**extend** over the rows the target just computed and kept, each row ``q`` with the target's
hidden state at ``q`` and the token at ``q + 1`` (the next prompt token, the next accepted
draft, or the token just sampled), whose last row drafts the first token; then ``steps - 1``
**decode** forwards, each row the previous MTP step's hidden state and draft. Step ``j`` runs
MTP layer ``min(j, layers) - 1`` (SGLang's reuse of the last layer). No overlap scheme splits
these forwards. A draft is the argmax, or for a sampled request a seeded draw from the MTP
head's own q, which stays on the rank for the next verification; under attention TP, rank 0
of the group decides every token and the others follow it (``runtime/mtp_picks.py``).

The MTP layers' keys and values live in the rank's paged KV cache, as layers
``num_hidden_layers + i`` on the target's pages and block table (``model/caches.py``): the
extend writes at the positions the target just computed, and decode step ``j`` at
``end + j - 1`` (``end``: the sequence's computed tokens after the step), up to ``steps - 1``
positions past it, pages the scheduler holds for it (``engine/speculation.py:
Speculation.writes_ahead``) and each forward reserves. An entry written for a draft lies past
the next extend's start, which writes over it; attention reads only ``[0, seq_len)``. So every
computed position's entry is the extend's, from the target's hidden state there and the token
after it, and a cached page carries them (``engine/page_keys.py``: with MTP a page's key holds
that token too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.step import GroupReply, SampleSpec
from moe_overlap.core.timeline import Timeline
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.loader import model_placement
from moe_overlap.overlap.operations import execute_operations
from moe_overlap.runtime.graph_buckets import rows_per_seq
from moe_overlap.runtime.mtp_graphs import DraftGraphs
from moe_overlap.runtime.mtp_picks import DraftProbs, pick, share


@dataclass
class _Rows:
    """The extend's rows of one sequence: where they start in the target batch, how many,
    the tokens they embed (each row's next token), whether it is drafted for, its sampling
    and the index of the first token it drafts (its drafts' seeds)."""

    seq: int
    start: int
    count: int
    tokens: list[int]
    drafts: bool
    spec: SampleSpec
    index: int


class MtpDrafter:
    def __init__(
        self,
        model: MoeForCausalLM,
        kv_cache: KVCache,
        steps: int,
        *,
        graph_max_bs: int = 0,
        capture: bool = True,
    ):
        """``kv_cache``: the rank's, built with the MTP layers' entries (``kv_cache_for(...,
        mtp=True)``; with graphs, its last slot the padding rows'); ``graph_max_bs``: the steps
        of up to this many sequences replay from CUDA graphs (0: never; ``capture=False`` runs
        their padded, buffer-fed forward eagerly)."""
        self.model, self.steps, self.max_len = model, steps, kv_cache.max_len
        self.layers = model.mtp_layers
        if not self.layers:
            raise ValueError("the MTP drafter needs a model built with its MTP layers")
        if len(kv_cache.layers) <= self.layers[-1].layer_id:
            raise ValueError("the KV cache holds no entries for the MTP layers")
        _, self.dtype = model_placement(model)
        self.kv_cache = kv_cache
        hidden_size = model.cfg.hidden_size
        self.graphs = (
            DraftGraphs(self.kv_cache, hidden_size, graph_max_bs, capture=capture)
            if graph_max_bs
            else None
        )
        embed = model.model.embed_tokens  # under --pp the last stage's copy (model/causal_lm.py)
        self.ops = [layer.mtp_ops(embed) for layer in self.layers]
        self.group = model.par.attn_tp  # its rank 0 picks, the others follow (mtp_picks.py)
        self.probs = DraftProbs()  # sampled drafts' q, for the next verification
        model.keep_hidden = True  # the target's forward returns every row's hidden state

    @torch.inference_mode()
    def draft(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor | None,
        samples: list[SampleSpec],
        reply: GroupReply | None,
        dispatcher: Dispatcher,
        timeline: Timeline,
    ) -> list[list[int]]:
        """Each sequence's drafts (empty where it gets none) after the target's forward of
        ``batch`` (``hidden``: its rows' final hidden states) and its ``reply`` (None on an
        attention-TP rank other than 0). Every rank runs ``steps`` forwards, with rows or
        without; a sampled sequence's q is kept in ``probs``."""
        self.probs.forget(batch.slots)
        drawn = self._drawn(batch, samples, reply)
        plan = [] if drawn is None else self._plan(batch, samples, drawn)
        logits, state = self._first_step(batch, hidden, plan, dispatcher, timeline)
        picks, probs = self._pick(logits, plan, 0)
        drafts, qs = [[p] for p in picks], [[q] for q in probs]
        ends = [batch.prefix_lens[r.seq] + r.count for r in plan]
        device = self.kv_cache.device
        for step in range(1, self.steps):
            chosen = [i for i, r in enumerate(plan) if r.drafts]
            dec = ForwardBatch(
                torch.tensor([drafts[i][-1] for i in chosen], dtype=torch.long),
                [batch.slots[plan[i].seq] for i in chosen],
                [ends[i] + step - 1 for i in chosen],
                [1] * len(chosen),
                [False] * len(chosen),
                [True] * len(chosen),
            )
            keep = torch.tensor(chosen, dtype=torch.long, device=device)
            out = self.forward(step, dec, state[keep], dispatcher, timeline)
            state = state.clone()
            state[keep] = out["hidden"]
            picks, probs = self._pick(out["logits"], [plan[i] for i in chosen], step)
            for i, p, q in zip(chosen, picks, probs, strict=True):
                drafts[i].append(p)
                qs[i].append(q)
        found = {r.seq: i for i, r in enumerate(plan) if r.drafts}
        for seq, i in found.items():
            self.probs.keep(batch.slots[seq], drafts[i], qs[i])
        return [drafts[found[i]] if i in found else [] for i in range(batch.num_seqs)]

    def _first_step(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor | None,
        plan: list[_Rows],
        dispatcher: Dispatcher,
        timeline: Timeline,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first MTP step, an extend over each planned sequence's rows: the logits and
        hidden state of each one's last row. From a graph, padded (``_padded``), where the
        drafter has graphs that hold it."""
        device = self.kv_cache.device
        padded = None if timeline.enabled else self._padded(batch, plan)
        if padded is not None and hidden is not None:
            out = self.forward(0, padded, hidden, dispatcher, timeline)
            width = padded.token_num_per_seq
            picked = [i * width + r.count - 1 for i, r in enumerate(plan)]
            keep = torch.tensor(picked, dtype=torch.long, device=device)
            return out["logits"][keep], out["hidden"][keep]
        ext = ForwardBatch(
            torch.tensor([t for r in plan for t in r.tokens], dtype=torch.long),
            [batch.slots[r.seq] for r in plan],
            [batch.prefix_lens[r.seq] for r in plan],
            [r.count for r in plan],
            [False] * len(plan),
            [False] * len(plan),
        )
        rows = torch.tensor([r.start + i for r in plan for i in range(r.count)], dtype=torch.long)
        inputs = hidden[rows.to(device)] if hidden is not None and plan else None
        if inputs is None:
            inputs = torch.zeros(0, self.model.cfg.hidden_size, dtype=self.dtype, device=device)
        out = self.forward(0, ext, inputs, dispatcher, timeline)
        last = torch.tensor(ext.logit_rows().tolist(), dtype=torch.long, device=device)
        return out["logits"], out["hidden"][last]

    def _padded(self, batch: ForwardBatch, plan: list[_Rows]) -> ForwardBatch | None:
        """The first step's extend as a graph holds it, or None: where ``batch`` decodes or
        verifies (w rows per sequence) and every sequence is planned, each sequence's rows
        padded to w by repeating its last token (SGLang's draft-extend graphs). The padding
        rows' entries lie past the sequence's end, which the next forward writes over before
        any row reads it, and no real row attends to them (they come after it)."""
        width = rows_per_seq([batch])
        if self.graphs is None or width is None or not plan or len(plan) != batch.num_seqs:
            return None
        if any(r.count > width for r in plan):
            return None
        n = len(plan)
        padded = ForwardBatch(
            torch.tensor([t for r in plan for t in r.tokens + r.tokens[-1:] * (width - r.count)]),
            batch.slots,
            batch.prefix_lens,
            [width] * n,
            [True] * n,
            [True] * n,
        )
        return padded if self.graphs.covers(padded) else None

    def forward(
        self,
        step: int,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        dispatcher: Dispatcher,
        timeline: Timeline,
    ) -> dict:
        """One MTP forward of step ``step`` (0-based), its layer the step's or the last; a
        step from its CUDA graph where the drafter has one that holds it."""
        layer = min(step, len(self.ops) - 1)

        def run(layer: int, batch: ForwardBatch, hidden: torch.Tensor) -> dict:
            ctx = ForwardContext(batch, self.kv_cache, dispatcher, timeline=timeline)
            return execute_operations(ctx, self.ops[layer], {"hidden": hidden})

        graphs = self.graphs
        if graphs is not None and not timeline.enabled and graphs.covers(batch):
            return graphs.forward(layer, batch, hidden, run)
        return run(layer, batch, hidden)

    def _pick(
        self, logits: torch.Tensor, plan: list[_Rows], step: int
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's pick of MTP step ``step`` and its q: attention-TP rank 0 picks, the
        others take its picks (``mtp_picks.share``) and keep no q."""
        if self.group.rank == 0:
            # a structured output's drafts are the argmax (one-hot): its grammar cuts them on
            # the driver, which would bias drafts drawn from an unconstrained q
            specs = [r.spec if r.drafts and r.spec.allowed is None else None for r in plan]
            picks, probs = pick(logits, specs, [r.index + step for r in plan])
        else:
            picks, probs = [], [None] * len(plan)
        if self.group.size > 1:
            rows = [[p] for p in picks] if self.group.rank == 0 else None
            picks = [row[0] for row in share(self.group, rows, len(plan), 1)]
        return picks, probs

    def _drawn(
        self, batch: ForwardBatch, samples: list[SampleSpec], reply: GroupReply | None
    ) -> list[list[int]] | None:
        """Per sequence, the tokens the step drew (empty: none), from the answering rank's
        ``reply`` on every rank of its attention-TP group; None: no rows (a rank that answers
        for nothing)."""
        if reply is None and self.group.size == 1:
            return None
        rows = None
        if reply is not None:
            rows = [
                [] if t is None else [t, *more]
                for t, more in zip(reply.token_ids, reply.more_ids, strict=True)
            ]
        width = 1 + max((len(s.drafts) for s in samples), default=0)
        return share(self.group, rows, batch.num_seqs, width)

    def _plan(
        self, batch: ForwardBatch, samples: list[SampleSpec], drawn: list[list[int]]
    ) -> list[_Rows]:
        """Per sequence, the target rows the extend takes and their next tokens: a sequence's
        rows up to its last accepted one, each embedding the token after it."""
        plan, start = [], 0
        ids = batch.input_ids.tolist()
        for i, (n, spec, got) in enumerate(zip(batch.extend_lens, samples, drawn, strict=True)):
            fed = ids[start : start + n]
            following = None if spec.draw else spec.following
            token = got[-1] if got else following
            count = len(got) if spec.drafts else n
            tokens = fed[1:count] + ([] if token is None else [token])
            end = batch.prefix_lens[i] + len(tokens)
            room = end + self.steps - 1 <= self.max_len
            drafts = bool(got) and room
            if tokens:
                plan.append(
                    _Rows(i, start, len(tokens), tokens, drafts, spec, spec.index + len(got))
                )
            start += n
        return plan
