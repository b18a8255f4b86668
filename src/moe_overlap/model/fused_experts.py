"""GPT-OSS's checkpoint layout of its experts: each layer's experts in one tensor per
projection, weights as ``[experts, in, out]``, and the gate and up columns of ``gate_up_proj``
interleaved (gate, up, gate, up, ...). ``FusedExperts`` cuts this rank's experts (its slots'
checkpoint experts, in slot order, replicas included under EPLB) and moe-TP rows out of such a
tensor into the ``ExpertBank`` layout (``[count, out, in]``, gate rows then up rows), and puts a
whole bank back for saving."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.model.moe import ExpertBank


@dataclass(frozen=True)
class FusedExperts:
    """Where a bank's tensor ``kind`` sits in the checkpoint's fused tensor of ``experts``."""

    kind: str
    logical: tuple[int, ...]  # the checkpoint expert each of the bank's slots holds (EPLB's)
    experts: int
    inter_start: int
    inter: int
    inter_full: int

    @classmethod
    def of(cls, kind: str, bank: ExpertBank, experts: int) -> FusedExperts:
        return cls(
            kind, bank.logical, experts, bank.inter_start, bank.intermediate, bank.inter_full
        )

    @property
    def is_whole(self) -> bool:
        return self.logical == tuple(range(self.experts)) and self.inter == self.inter_full

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        e, i = self.experts, self.inter_full
        if self.kind == "gate_up_proj":
            return (e, local[2], 2 * i)
        if self.kind == "gate_up_proj_bias":
            return (e, 2 * i)
        if self.kind == "down_proj":
            return (e, i, local[1])
        return (e, local[1])

    def take(self, whole: torch.Tensor, local: torch.Size) -> torch.Tensor:
        first = self.logical[0]
        if self.logical == tuple(range(first, first + len(self.logical))):
            w = whole[first : first + len(self.logical)]  # a run of experts: a view
        else:  # EPLB's slots: any experts, a replica's more than once
            w = whole[torch.tensor(self.logical)]
        a, b = self.inter_start, self.inter_start + self.inter
        if self.kind == "gate_up_proj":
            w = w[..., 2 * a : 2 * b]
            return torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1).transpose(1, 2)
        if self.kind == "gate_up_proj_bias":
            w = w[..., 2 * a : 2 * b]
            return torch.cat((w[..., 0::2], w[..., 1::2]), dim=-1)
        if self.kind == "down_proj":
            return w[:, a:b].transpose(1, 2)
        return w

    def whole(self, local: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor of a whole bank (one process)."""
        assert self.is_whole, "saving needs every expert's whole width"
        if self.kind in ("gate_up_proj", "gate_up_proj_bias"):
            fused = local.transpose(1, 2) if self.kind == "gate_up_proj" else local
            gate, up = fused.chunk(2, dim=-1)
            return torch.stack((gate, up), dim=-1).flatten(-2)
        return local.transpose(1, 2) if self.kind == "down_proj" else local
