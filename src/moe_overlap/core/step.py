"""What the driver asks the ranks each step (``StepRequest``), and what they answer
(``StepReply``).

The ranks sample: a step's reply carries each sequence's next token id (and its
log-probabilities when asked), not its logits. Logits travel only for sequences whose batch
asks for every position's (``ForwardBatch.all_logits``, the exactness tests' ``return_logits``)
and for a forward-only request (``samples`` None: the bench and the tests' logit checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_modes import NONE
from moe_overlap.core.timeline import Span


@dataclass(frozen=True)
class Penalties:
    """vLLM's logit adjustments, made before temperature and the cuts (never to logprobs):
    stop tokens masked until ``min_tokens`` are generated, ``logit_bias`` added, repeated
    tokens penalised. Only a sequence that asks for one carries these, with its history."""

    presence: float = 0.0  # subtracted once from every token already generated
    frequency: float = 0.0  # subtracted per time a token was generated
    repetition: float = 1.0  # > 1 divides positive and multiplies negative logits of seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # EOS and the stop token ids, masked below min_tokens
    prompt_ids: tuple[int, ...] = ()  # seen, for the repetition penalty
    output_ids: tuple[int, ...] = ()  # generated so far


@dataclass(frozen=True)
class SampleSpec:
    """How to pick one sequence's next token from its last logits row."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut
    # the draw's seed: a request's seed and the index of the token it draws, so the same
    # request gives the same tokens whichever rank samples it and in whatever batch
    seed: int = 0
    index: int = 0
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k's
    draw: bool = True  # False: a prompt chunk that does not end the prompt
    keep_logits: bool = False  # its logit rows come back (the exactness tests)
    prompt_logprobs: int | None = None
    next_ids: tuple[int, ...] = ()  # the prompt tokens its rows predict, to score them
    penalties: Penalties | None = None
    # structured outputs: the tokens the grammar allows, a bitmask per row the draw reads (bit
    # t % 32 of the little-endian int32 word t // 32): the deciding row's, then in a verify
    # step the row after each draft the grammar allows, up to the first it refuses (the drafts
    # from there on are not verified); the others are masked before penalties and the draw
    allowed: tuple[bytes, ...] | None = None
    # speculative decoding: the draft tokens fed after the last one (a target-verify row each);
    # its first row then decides the next token and verification checks ``checked_drafts``
    drafts: tuple[int, ...] = ()
    # the token after the fed ones where this step draws none (a prompt chunk that does not
    # end the prompt): the MTP drafter embeds it at the chunk's last row
    following: int | None = None
    min_p: float = 0.0  # tokens below min_p x the likeliest's probability are dropped (0: off)

    @property
    def verifies(self) -> bool:
        """It carries drafts, which are verified: greedily, or by rejection sampling, with its
        penalties and its grammar's bitmasks applied per row."""
        return bool(self.drafts)

    @property
    def checked_drafts(self) -> tuple[int, ...]:
        """The drafts verification checks: all, or a structured output's that its grammar
        allows (one per bitmask after the first)."""
        return self.drafts if self.allowed is None else self.drafts[: len(self.allowed) - 1]


@dataclass
class TokenLogprobs:
    """One position's log-probabilities (fp32 log-softmax of the model's logits, before any
    temperature or cut): the token's, its rank (1: the likeliest) and the ``top`` k."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class WaveSlice:
    """PD multiplexing: the layer range of a prefill wave that ranks run beside the step."""

    batches: list[ForwardBatch]  # one per data-parallel group (idle where it has none)
    layers: range
    wave: int  # names the ranks' saved hidden states between ranges
    last: bool  # the final range: its sequences are sampled
    samples: list[list[SampleSpec]] | None = None  # per group, with the last range


@dataclass
class PageOps:
    """One group's KV page changes before its step's forward, applied in this order (the
    driver's prefix cache decides them; ``core/kv_cache.py: KVCache.apply`` carries them out).
    ``publish``: (slot, page index, id): a full, computed page of a running sequence becomes a
    cached page named ``id``. ``released``: slots whose sequences ended (their pages go back,
    cached ones stay cached). ``evict``: cached pages no sequence holds, freed. ``unwindow``:
    cached pages whose sliding-window layers' page goes back (no sequence's window holds it;
    the page stays cached, ``core/window_table.py``). ``attach``: (slot, ids): a new
    sequence's first pages are those cached pages. Hybrid models' recurrent
    states (``core/state_snapshots.py``), after the pages: ``restore``: (slot, entry, tokens):
    a new sequence starts from the state kept in snapshot ``entry``, after ``tokens`` tokens;
    ``snapshot``: (slot, boundary, entry): keep the state of the sequence in ``slot`` after
    ``boundary`` tokens in ``entry`` when a forward passes that boundary."""

    publish: list[tuple[int, int, int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    evict: list[int] = field(default_factory=list)
    unwindow: list[int] = field(default_factory=list)
    attach: list[tuple[int, list[int]]] = field(default_factory=list)
    restore: list[tuple[int, int, int]] = field(default_factory=list)
    snapshot: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class StepRequest:
    batches: list[ForwardBatch]  # one per data-parallel group
    # per group, per sequence: what its rank does with its logits; None for the whole step:
    # return every logit row instead
    samples: list[list[SampleSpec]] | None = None
    overlap: OverlapConfig | None = None  # this step's scheme instead of the engine's
    record: bool = False  # each rank's timeline spans come back
    prefill: WaveSlice | None = None
    # per group: KV pages freed, cached and shared since the last step
    pages: list[PageOps] | None = None

    def group_samples(self, group: int) -> list[SampleSpec] | None:
        return None if self.samples is None else self.samples[group]


@dataclass
class GroupReply:
    """One data-parallel group's answer for its batch (sequences in batch order)."""

    token_ids: list[int | None] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)  # a sequence whose draw failed
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # scored rows
    # the logit rows of the sequences with ``keep_logits`` (every row: a forward-only step)
    logits: torch.Tensor | None = None
    mode: str = NONE.name  # the overlap scheme the forward ran (auto's choice)
    # speculative decoding, per sequence: the tokens verification adds after ``token_ids[i]``
    # (the target's argmax at each accepted draft, the last one the bonus), with logprobs
    more_ids: list[list[int]] = field(default_factory=list)
    more_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    # the MTP drafter's drafts after this step's tokens, per sequence (empty: none), which the
    # driver feeds in the sequence's next verify step (runtime/mtp_drafter.py)
    drafts: list[list[int]] = field(default_factory=list)
    # linear-attention slots whose recurrent state this step rolled back to the rows the
    # last verify step accepted (core/state_cache.py: StateCache.settle)
    rollbacks: int = 0

    def __getstate__(self) -> dict:  # logits cross processes as NumPy, not torch's fd sharing
        state = dict(self.__dict__)
        if self.logits is not None:
            state["logits"] = self.logits.numpy()
        return state

    def __setstate__(self, state: dict) -> None:
        logits = state["logits"]
        state["logits"] = None if logits is None else torch.from_numpy(np.asarray(logits))
        self.__dict__.update(state)


@dataclass
class StepReply:
    groups: list[GroupReply]
    spans: list[list[Span] | None]  # per rank, with ``record``
    wave: list[GroupReply] | None = None  # per group, after a prefill wave's last range

    @property
    def logits(self) -> list[torch.Tensor]:
        """Each group's logit rows (a forward-only step returns all of them)."""
        return [g.logits if g.logits is not None else torch.zeros(0) for g in self.groups]
