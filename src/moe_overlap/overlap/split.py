"""Split a ForwardBatch into micro-batches, and merge their logits back.

A plan is a list of children; a child is a list of ``Piece(seq, start, length)``: tokens
``start .. start + length - 1`` of this forward's new tokens of sequence ``seq``. A sequence cut
in two keeps its KV cache row, and its later piece carries the earlier one as prefix, so the
result is exact as long as the earlier piece runs each layer's attention first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moe_overlap.core.batch import DecodeInputs, ForwardBatch, ForwardMode
from moe_overlap.core.model_flops import ModelFlops
from moe_overlap.core.stage_io import ForwardOutputs, StageInputs
from moe_overlap.core.transfer import to_device


@dataclass(frozen=True)
class Piece:
    seq: int
    start: int
    length: int


Plan = list[list[Piece]]


def balanced_seq_split(lens: list[int]) -> int:
    """SGLang's ``_split_array_by_balanced_sum``: the cut ``i`` minimising
    |sum(lens[:i]) - sum(lens[i:])|, the later one on a tie; 0 for fewer than two sequences."""
    total, left, best, best_gap = sum(lens), 0, 0, None
    for i in range(1, len(lens)):
        left += lens[i - 1]
        gap = abs(2 * left - total)
        if best_gap is not None and gap > best_gap:
            break  # SGLang stops at the first increase (the gap is V-shaped)
        best, best_gap = i, gap
    return best


def half_token_seq(lens: list[int]) -> int:
    """SGLang's ``_split_array_by_cum_less_than_half``: the sequence holding token
    ``sum(lens) // 2`` (the first whose running total passes it), 0 if none does."""
    half, running = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        running += n
        if running > half:
            return i
    return 0


def needs_two_chunk(lens: list[int], threshold: float) -> bool:
    """SGLang's ``_is_two_chunk_split_enabled``: the balanced sequence split leaves a share
    strictly outside [threshold, 1 - threshold], and the first micro-batch would get no more
    sequences than tokens (else, e.g. one one-token sequence, the sequence split is used)."""
    total = sum(lens)
    left = sum(lens[: balanced_seq_split(lens)])
    # SGLang's own float expression, so the edges fall where they fall there
    if not (left < total * threshold or left > total * (1 - threshold)):
        return False
    return half_token_seq(lens) + 1 <= total // 2


def token_split(lens: list[int], cuts: list[int]) -> Plan:
    """Cut the concatenated tokens at the given token offsets (ascending) into pieces."""
    bounds = [0, *cuts, sum(lens)]
    plan: Plan = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        child, offset = [], 0
        for seq, n in enumerate(lens):
            start, end = max(lo, offset), min(hi, offset + n)
            if start < end:
                child.append(Piece(seq, start - offset, end - start))
            offset += n
        plan.append(child)
    return plan


def whole(batch: ForwardBatch) -> list[Piece]:
    """Every sequence of ``batch``, entire: one child holding the whole batch."""
    return [Piece(i, 0, n) for i, n in enumerate(batch.extend_lens)]


def seq_split(lens: list[int], index: int) -> Plan:
    return [
        [Piece(i, 0, lens[i]) for i in range(index)],
        [Piece(i, 0, lens[i]) for i in range(index, len(lens))],
    ]


def time_balanced_cuts(batch: ForwardBatch, cost: ModelFlops, parts: int) -> list[int]:
    """Token offsets cutting the batch into ``parts`` children of (nearly) equal estimated
    cost: quantiles of the running cost, each child keeping at least one token."""
    running = torch.cumsum(cost.token_costs(batch), 0)
    targets = running[-1] * torch.arange(1, parts, dtype=torch.float64) / parts
    total, fixed = batch.num_tokens, list[int]()
    crossings = torch.searchsorted(running, targets)
    for k, (target, i) in enumerate(zip(targets, crossings, strict=True), start=1):
        i = int(i)  # token i's running cost first reaches the target: cut before it, or after
        below = running[i - 1] if i > 0 else 0.0
        cut = i if abs(target - below) <= abs(running[i] - target) else i + 1
        low = fixed[-1] + 1 if fixed else 1  # strictly increasing, room for the later children
        fixed.append(min(max(cut, low), total - (parts - k)))
    return fixed


def plan_two_batch(batch: ForwardBatch, threshold: float, cost: ModelFlops | None = None) -> Plan:
    """SGLang's two-batch split: decode gives the first micro-batch floor(n / 2) sequences;
    extend balances tokens by sequence, and cuts a sequence in two (two-chunk overlap) when
    that split is lopsided. With a ``cost`` model the cut balances estimated time instead of
    tokens (ours). Target verify splits by whole sequences, never inside one's drafts."""
    lens = batch.extend_lens
    if batch.mode == ForwardMode.DECODE:
        return seq_split(lens, len(lens) // 2)
    if batch.mode == ForwardMode.TARGET_VERIFY:  # SGLang's rule; two-chunk and time never cut
        return seq_split(lens, (batch.num_tokens // batch.token_num_per_seq) // 2)
    if needs_two_chunk(lens, threshold):
        cut = time_balanced_cuts(batch, cost, 2)[0] if cost is not None else sum(lens) // 2
        return token_split(lens, [cut])
    return seq_split(lens, balanced_seq_split(lens))


def plan_even_tokens(batch: ForwardBatch, parts: int, cost: ModelFlops | None = None) -> Plan:
    """N micro-batches of (nearly) equal token counts, cutting sequences where needed; with a
    ``cost`` model, of (nearly) equal estimated time instead. A target-verify batch is cut
    between sequences into ``parts`` runs of (nearly) equal counts."""
    total = batch.num_tokens
    if batch.mode == ForwardMode.TARGET_VERIFY:
        lens, n = batch.extend_lens, batch.num_seqs
        bounds = [n * k // parts for k in range(parts + 1)]
        return [
            [Piece(i, 0, lens[i]) for i in range(a, b)]
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    if cost is not None and total >= parts:
        return token_split(batch.extend_lens, time_balanced_cuts(batch, cost, parts))
    return token_split(batch.extend_lens, [total * k // parts for k in range(1, parts)])


def split_batch(batch: ForwardBatch, plan: Plan) -> list[ForwardBatch]:
    """The child ForwardBatch of each plan entry (an empty entry gives an idle batch)."""
    starts = _seq_starts(batch)
    children = []
    for child in plan:
        if not child:
            children.append(ForwardBatch.idle())
            continue
        ids = [
            batch.input_ids[starts[p.seq] + p.start : starts[p.seq] + p.start + p.length]
            for p in child
        ]
        children.append(
            ForwardBatch(
                input_ids=torch.cat(ids),
                slots=[batch.slots[p.seq] for p in child],
                prefix_lens=[batch.prefix_lens[p.seq] + p.start for p in child],
                extend_lens=[p.length for p in child],
                all_logits=[batch.all_logits[p.seq] for p in child],
                is_decode=[batch.is_decode[p.seq] for p in child],
                device_inputs=_staged_rows(batch, child),
            )
        )
    return children


def _staged_rows(batch: ForwardBatch, child: list[Piece]) -> DecodeInputs | None:
    """A child's rows of the parent's device buffers (a CUDA graph's decode or verify batch,
    cut into a contiguous run of token rows: by sequences, or DBO's token cut)."""
    if batch.device_inputs is None:
        return None
    starts = _seq_starts(batch)
    spans = [(starts[p.seq] + p.start, starts[p.seq] + p.start + p.length) for p in child]
    if any(a[1] != b[0] for a, b in itertools.pairwise(spans)):
        raise ValueError("a batch in device buffers splits only into contiguous runs of rows")
    return batch.device_inputs.rows(spans[0][0], spans[-1][1])


def merge_logits(batch: ForwardBatch, plan: Plan, logits: list[torch.Tensor]) -> torch.Tensor:
    """Reassemble the children's logits into the rows ``batch.logit_rows()`` promises: one
    concatenation, then one gather of the rows kept, in sequence order (none when they are
    already in order: a decode batch cut by sequences)."""
    rows_of: dict[int, list[range]] = {}
    offset = 0  # the child's first row in the concatenation
    for child, child_logits in zip(plan, logits, strict=True):
        row = offset
        for p in child:
            every = batch.all_logits[p.seq]
            n = p.length if every else 1
            ends_seq = p.start + p.length == batch.extend_lens[p.seq]
            if every or ends_seq:  # a cut piece's last-token row is not the sequence's
                rows_of.setdefault(p.seq, []).append(range(row, row + n))
            row += n
        offset += child_logits.shape[0]
    if not rows_of:
        return logits[0][:0] if logits else torch.zeros(0)
    rows = [i for s in range(batch.num_seqs) for span in rows_of[s] for i in span]
    whole = torch.cat(logits)
    if rows == list(range(whole.shape[0])):
        return whole
    return whole[to_device(torch.tensor(rows, dtype=torch.long), whole.device)]


def _seq_starts(batch: ForwardBatch) -> list[int]:
    starts, offset = [], 0
    for n in batch.extend_lens:
        starts.append(offset)
        offset += n
    return starts


def child_rows(batch: ForwardBatch, plan: Plan) -> list[torch.Tensor]:
    """Each child's token rows in the parent batch, in the child's order."""
    starts = _seq_starts(batch)
    return [
        torch.cat(
            [torch.arange(starts[p.seq] + p.start, starts[p.seq] + p.start + p.length) for p in c]
        )
        if c
        else torch.zeros(0, dtype=torch.long)
        for c in plan
    ]


def split_inputs(batch: ForwardBatch, plan: Plan, inputs: StageInputs | None) -> list[dict]:
    """A pipeline stage's inputs (per-token tensors of the whole batch) cut for each child,
    as its first op takes them; none (the first stage) gives each child none."""
    if inputs is None:
        return [{} for _ in plan]
    whole = inputs.as_dict()
    return [{k: v[rows] for k, v in whole.items()} for rows in child_rows(batch, plan)]


def merge_outputs(batch: ForwardBatch, plan: Plan, outs: list[dict]) -> ForwardOutputs:
    """The children's outputs as the whole batch's: logits (the last stage), or the per-token
    ``hidden_states`` and ``residual`` an earlier stage hands on."""
    if "logits" in outs[0]:
        logits = merge_logits(batch, plan, [o["logits"] for o in outs])
        hidden = (
            _merge_rows(batch, plan, [o["hidden"] for o in outs]) if "hidden" in outs[0] else None
        )
        return ForwardOutputs(logits=logits, hidden=hidden)
    return ForwardOutputs.of(
        {key: _merge_rows(batch, plan, [o[key] for o in outs]) for key in outs[0]}
    )


def _merge_rows(batch: ForwardBatch, plan: Plan, parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-token tensors of the children as the whole batch's, in its row order."""
    whole = parts[0].new_empty((batch.num_tokens, *parts[0].shape[1:]))
    for rows, part in zip(child_rows(batch, plan), parts, strict=True):
        whole[rows] = part
    return whole
