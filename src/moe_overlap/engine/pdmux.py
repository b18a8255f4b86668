"""PD multiplexing (SGLang's ``--enable-pdmux``), the driver's side: split prefill.

Prompts are prefilled whole (no chunking) in waves: a wave takes each data-parallel group's
waiting prompts, up to the token budget, and advances one layer range per step, beside that
step's decode batch, which the ranks run at the same time on a lane of their own. A 3072-token
prompt thus costs each decode step a range of its layers instead of all of them at once. The
wave's logits come back with its last range; its requests then decode like any other.
A prompt that found pages in the prefix cache joins its wave after them: the wave's batch
starts at its cached tokens, whose KV its attention reads from the attached pages.
"""

from __future__ import annotations

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.step import WaveSlice
from moe_overlap.engine.request import Request

DEFAULT_PREFILL_SPLITS = 4  # layer ranges a prompt's prefill is cut into


def layer_ranges(num_layers: int, splits: int) -> list[range]:
    """``num_layers`` cut into ``min(splits, num_layers)`` contiguous, nearly equal ranges."""
    n = min(splits, num_layers)
    bounds = [num_layers * k // n for k in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class PrefillWaves:
    def __init__(self, num_layers: int, splits: int, budget: int):
        self.ranges = layer_ranges(num_layers, splits)
        self.budget = budget
        self.members: list[list[Request]] | None = None  # per group, the wave in flight
        self.batches: list[ForwardBatch] = []
        self.index, self.count = 0, 0

    @classmethod
    def of(cls, enabled: bool, cfg: ModelConfig, splits: int, budget: int) -> PrefillWaves | None:
        """``--enable-pdmux``'s waves over ``cfg``'s layers, or None where it is off."""
        return cls(cfg.num_hidden_layers, splits, budget) if enabled else None

    def in_wave(self, req: Request) -> bool:
        return self.members is not None and any(req in group for group in self.members)

    def next_slice(self, running: list[list[Request]], make_batch) -> WaveSlice | None:
        """Advance the wave in flight by one range, or start one from the waiting prompts."""
        if self.members is None:
            members = [self._take(group) for group in running]
            if not any(members):
                return None
            self.members, self.index, self.count = members, 0, self.count + 1
            self.batches = [make_batch([(r, uncached(r)) for r in group]) for group in members]
        else:
            self.index += 1
        last = self.index == len(self.ranges) - 1
        return WaveSlice(self.batches, self.ranges[self.index], self.count, last)

    def finish(self) -> list[list[Request]]:
        """The wave whose last range just ran: its requests, per group."""
        members, self.members = self.members or [], None
        return members

    def _take(self, group: list[Request]) -> list[Request]:
        """Whole prompts waiting in ``group``, within the token budget (at least one)."""
        taken: list[Request] = []
        tokens = 0
        for req in group:
            n = len(uncached(req))
            if req.in_prefill and (not taken or tokens + n <= self.budget):
                taken.append(req)
                tokens += n
        return taken


def uncached(req: Request) -> list[int]:
    """The prompt tokens a wave prefills: those past the pages found in the prefix cache."""
    return req.prompt_ids[req.num_computed :]
