"""What the MTP drafter picks, and how the ranks of an attention-TP group agree on it.

**Picks.** A greedy sequence's draft is the MTP head's argmax. A sampled one's (temperature
> 0) is drawn from the drafter's own distribution q (the MTP logits under the request's
temperature, top-k and top-p, ``runtime/draws.py: probabilities``) by a seeded draw of its own
(``draft_seed``: the request's seed and the drafted token's index, on a stream apart from the
target's draws), so the same request drafts the same tokens in every run. Its q is kept on the
rank (``DraftProbs``) and handed to the next verification, which accepts x with probability
min(1, p(x) / q(x)) (``runtime/verification.py``); the driver sees the drafts only.

**Attention TP.** The group's attention-TP rank 0 samples (it answers for the group), so it
decides every token the drafter embeds: the tokens the step drew, and each MTP step's picks.
The other ranks follow it: ``share`` hands them rank 0's values (one all-reduce of a small
integer table, the followers adding zeros), so every rank of the group runs the MTP layer's
TP-sharded attention over the same rows and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.step import SampleSpec
from moe_overlap.distributed.groups import Group
from moe_overlap.runtime.draws import draw, draw_seed, probabilities

_DRAFT_STREAM = 0x5D7A3C1B  # the drafter's draws: a seed stream apart from the target's


def draft_seed(seed: int, index: int) -> int:
    """The seed of the drafter's draw of a request's ``index``-th token."""
    return draw_seed(seed ^ _DRAFT_STREAM, index)


def pick(
    logits: torch.Tensor, specs: list[SampleSpec | None], indices: list[int]
) -> tuple[list[int], list[torch.Tensor | None]]:
    """Each row's draft and its q (None: the argmax, a one-hot draft): ``specs[r]`` None or
    greedy takes the argmax; a sampled one draws its ``indices[r]``-th token from q."""
    picks = logits.argmax(-1).tolist() if logits.numel() else []
    probs: list[torch.Tensor | None] = [None] * len(picks)
    for r, (spec, index) in enumerate(zip(specs, indices, strict=True)):
        if spec is not None and spec.temperature > 0.0:
            q = probabilities(logits[r], spec)
            picks[r], probs[r] = draw(q, draft_seed(spec.seed, index)), q
    return picks, probs


def share(group: Group, rows: list[list[int]] | None, count: int, width: int) -> list[list[int]]:
    """Attention-TP rank 0's ``rows`` (``count`` lists of at most ``width`` ints) on every rank
    of ``group``; the others pass None. One process: ``rows`` as they are."""
    if group.size == 1:
        assert rows is not None, "a group of one is its own rank 0"
        return rows
    table = torch.zeros((count, max(width, 1)), dtype=torch.long, device=group.device)
    if group.rank == 0:
        assert rows is not None, "attention-TP rank 0 decides the drafter's tokens"
        table.fill_(-1)  # padding past each row's end
        for r, values in enumerate(rows):
            table[r, : len(values)] = torch.tensor(values, dtype=torch.long)
    group.all_reduce(table)  # the followers' zeros leave rank 0's values
    return [[v for v in row if v >= 0] for row in table.tolist()]


@dataclass
class _Kept:
    drafts: tuple[int, ...]
    probs: torch.Tensor  # [drafts, vocab]: each draft's q


class DraftProbs:
    """The q of each slot's latest sampled drafts, on the rank that verifies them."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}

    def forget(self, slots: list[int]) -> None:
        """Before a step's drafts: the slots' earlier ones are spent (or the slot has a new
        sequence)."""
        for slot in slots:
            self._kept.pop(slot, None)

    def keep(self, slot: int, drafts: list[int], probs: list[torch.Tensor | None]) -> None:
        """A sampled sequence's drafts with their q (greedy ones need none: one-hot)."""
        if drafts and all(q is not None for q in probs):
            self._kept[slot] = _Kept(
                tuple(drafts), torch.stack([q for q in probs if q is not None])
            )

    def of(self, batch: ForwardBatch, samples: list[SampleSpec]) -> list[torch.Tensor | None]:
        """Per sequence of a verify batch, the q of the drafts it carries (its first ``k`` of
        the kept ones); None where it carries others (padding) or none were sampled."""
        found: list[torch.Tensor | None] = []
        for slot, spec in zip(batch.slots, samples, strict=True):
            kept, k = self._kept.get(slot), len(spec.drafts)
            fits = kept is not None and k and kept.drafts[:k] == spec.drafts
            found.append(kept.probs[:k] if fits and kept is not None else None)
        return found
