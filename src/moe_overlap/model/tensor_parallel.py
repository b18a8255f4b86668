"""Tensor-parallel building blocks: the linears know their group, the layers do not branch.

Every sharded weight carries a ``Shard``: which slice of the checkpoint tensor it holds. The
loader and the seeded initialiser read it, so a rank builds exactly the weights a single
process would, cut to its slice. On a one-rank group every block is the plain layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.expert_location import ExpertPlacement
from moe_overlap.distributed.groups import Group


@dataclass(frozen=True)
class Shard:
    """This tensor is ``full.narrow(dim, start, length)``; rows past the checkpoint's end (a
    vocabulary padded to a multiple of the TP size) are zeros."""

    dim: int
    start: int
    full: int  # the checkpoint tensor's size along ``dim``

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.full
        return tuple(shape)

    def take(self, whole: torch.Tensor, local: torch.Size) -> torch.Tensor:
        length = local[self.dim]
        stop = min(self.start + length, self.full)
        part = whole.narrow(self.dim, self.start, max(0, stop - self.start))
        if part.shape[self.dim] == length:
            return part
        pad = list(local)
        pad[self.dim] = length - part.shape[self.dim]
        return torch.cat((part, part.new_zeros(pad)), dim=self.dim)


@dataclass(frozen=True)
class Segments:
    """This tensor is the concatenation along ``dim`` of ``full.narrow(dim, start, length)``
    for each ``(start, length)`` of ``parts``: a fused projection whose parts are each split
    by heads (Qwen3.5's ``in_proj_qkv``: this rank's query, key and value heads). An FP8
    weight cut so is dequantized at load (``fp8_resident.py: column_block``)."""

    dim: int
    parts: tuple[tuple[int, int], ...]
    full: int

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        return Shard(self.dim, 0, self.full).full_shape(local)

    def take(self, whole: torch.Tensor, local: torch.Size) -> torch.Tensor:
        return torch.cat([whole.narrow(self.dim, a, n) for a, n in self.parts], dim=self.dim)

    def simplest(self) -> Segments | Shard:
        """A ``Shard`` where the parts run on one from another (one rank holds them all), so
        what reads only shards (an FP8 weight kept resident) takes it as any other."""
        (first, _), ends = self.parts[0], [a + n for a, n in self.parts]
        if all(a == end for (a, _), end in zip(self.parts[1:], ends, strict=False)):
            return Shard(self.dim, first, self.full)
        return self


def set_shard(param: torch.Tensor, dim: int, start: int, full: int) -> None:
    param.shard = Shard(dim, start, full)  # type: ignore[attr-defined]  # read by the loader


def even_part(size: int, rank: int, parts: int) -> range:
    """Rank's contiguous share of ``size`` items cut into ``parts`` equal pieces."""
    per = size // parts
    return range(rank * per, (rank + 1) * per)


@dataclass
class ModelParallel:
    """What the model needs of the layout: the attention-TP group (attention, dense MLPs, the
    vocabulary) and this rank's share of the routed experts."""

    attn_tp: Group
    ep_rank: int = 0
    ep_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1
    layers: range | None = None  # this pipeline stage's layers (None: all)
    placement: ExpertPlacement | None = None  # EPLB's slots per MoE layer (None: E/ep each)

    @classmethod
    def single(cls) -> ModelParallel:
        return cls(Group.single(name="attn_tp"))


class ColumnLinear(nn.Module):
    """``x W^T`` for output rows ``rows`` of the full ``[out_features, in_features]`` weight;
    no communication (the output stays sharded)."""

    def __init__(self, in_features: int, out_features: int, rows: range, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(len(rows), in_features))
        set_shard(self.weight, 0, rows.start, out_features)
        self.w8a8: nn.Module | None = None  # an FP8 weight's scaled GEMM (model/fp8_w8a8.py)
        self.bias = None
        if bias:  # GLM-4.5's q/k/v: cut like the rows
            self.bias = nn.Parameter(torch.zeros(len(rows)))
            set_shard(self.bias, 0, rows.start, out_features)

    @classmethod
    def segments(cls, in_features: int, out_features: int, parts: Segments) -> ColumnLinear:
        """Output rows ``parts`` of the full weight, each part a range of its rows."""
        linear = cls(in_features, out_features, range(sum(n for _, n in parts.parts)))
        linear.weight.shard = parts.simplest()  # type: ignore[attr-defined]  # the loader's
        return linear

    @classmethod
    def even(
        cls, in_features: int, out_features: int, group: Group, bias: bool = False
    ) -> ColumnLinear:
        rows = even_part(out_features, group.rank, group.size)
        return cls(in_features, out_features, rows, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w8a8 is not None:
            return self.w8a8(x, self.bias)
        return F.linear(x, self.weight, self.bias)


class RowLinear(nn.Module):
    """Input columns sharded over ``group``; the partial products are all-reduced."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False):
        super().__init__()
        cols = even_part(in_features, group.rank, group.size)
        self.weight = nn.Parameter(torch.zeros(out_features, len(cols)))
        set_shard(self.weight, 1, cols.start, in_features)
        self.w8a8: nn.Module | None = None  # as ColumnLinear's
        self.group = group
        # GPT-OSS's o_proj: the whole bias on every rank, added once, after the all-reduce
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight) if self.w8a8 is None else self.w8a8(x)
        if self.group.size > 1 and y.numel():  # every rank of the group has the same rows
            self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _vocab_part(vocab: int, group: Group) -> range:
    per = -(-vocab // group.size)  # padded to a multiple of the group size
    return range(group.rank * per, (group.rank + 1) * per)


class VocabEmbedding(nn.Module):
    """Vocabulary rows split over ``group``; each rank embeds the ids it holds, zeros the rest,
    and the group sums."""

    def __init__(self, vocab: int, hidden: int, group: Group):
        super().__init__()
        self.rows, self.group = _vocab_part(vocab, group), group
        self.weight = nn.Parameter(torch.zeros(len(self.rows), hidden))
        set_shard(self.weight, 0, self.rows.start, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.weight.device)  # a batch's ids are host data
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)  # no boolean index: no read back on a GPU
        if out.numel():
            self.group.all_reduce(out)
        return out


class VocabHead(nn.Module):
    """The LM head over a vocabulary split like ``VocabEmbedding``; the logits are gathered and
    the padding columns dropped, so no padded id can ever be sampled."""

    def __init__(self, hidden: int, vocab: int, group: Group):
        super().__init__()
        self.vocab, self.group = vocab, group
        rows = _vocab_part(vocab, group)
        self.weight = nn.Parameter(torch.zeros(len(rows), hidden))
        set_shard(self.weight, 0, rows.start, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.group.size == 1:
            return logits[:, : self.vocab]
        if not x.shape[0]:  # no rows on any rank of the group: nothing to gather, the full width
            return logits.new_empty(0, self.vocab)
        gathered = self.group.all_gather(logits.t().contiguous())  # [padded vocab, rows]
        return gathered[: self.vocab].t()
