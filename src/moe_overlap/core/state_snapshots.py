"""Recurrent states kept at cached page boundaries, so a hybrid model's prefix can be cached.

A linear-attention layer's state summarises a whole prefix, so a request that finds a prefix's
pages cached can skip it only if the state after exactly those tokens was kept too (SGLang's
mamba radix cache keeps one at a cached prefix's end; vLLM aligns its blocks to the state).
The driver decides where (``engine/prefix_states.py``): it names a boundary of a sequence and a
snapshot entry (``PageOps.snapshot``), and the linear-attention layer that passes the boundary
stores the state there (``cuts``, ``keep``), cutting its delta rule at the boundary when a
prefill piece crosses it. A later request on the same pages starts from a copy of that entry
(``PageOps.restore``). The entries are a fixed pool, grown as used up to ``num_entries``; the
driver alone knows which entry holds which prefix, and reuses one once its page is evicted.
"""

from __future__ import annotations

import torch

from moe_overlap.core.step import PageOps


class StateSnapshots:
    """Per linear-attention layer: ``conv [entries, channels, kernel - 1]`` and
    ``ssm [entries, heads, dk, dv]`` (float32), and per slot the boundaries to keep."""

    def __init__(
        self,
        layers: dict[int, tuple[tuple[int, ...], tuple[int, ...]]],
        num_entries: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_entries, self.device = num_entries, torch.device(device)
        self.conv = {
            i: torch.zeros(0, *c, dtype=dtype, device=device) for i, (c, _) in layers.items()
        }
        self.ssm = {i: torch.zeros(0, *s, device=device) for i, (_, s) in layers.items()}
        self.plan: dict[int, list[tuple[int, int]]] = {}  # slot -> (boundary, entry)

    def apply(self, ops: PageOps) -> list[tuple[int, int, int]]:
        """Forget the plans of released slots and take the new ones; returns the restores
        (slot, entry, tokens) for the state cache to carry out."""
        for slot in ops.released:
            self.plan.pop(slot, None)
        for slot, boundary, entry in ops.snapshot:
            if not 0 <= entry < self.num_entries:
                raise IndexError(f"snapshot entry {entry} outside the {self.num_entries} kept")
            self.plan.setdefault(slot, []).append((boundary, entry))
        return ops.restore

    def cuts(self, slot: int, start: int, end: int) -> list[tuple[int, int]]:
        """The (boundary, entry) pairs of ``slot`` that a piece of tokens ``[start, end)``
        passes (``start < boundary <= end``), in order."""
        return sorted((b, e) for b, e in self.plan.get(slot, ()) if start < b <= end)

    def keep(self, layer: int, entry: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store one sequence's state ``conv [channels, kernel - 1]``, ``ssm [heads, dk, dv]``."""
        self._reserve(layer, entry + 1)
        self.conv[layer][entry] = conv.to(self.conv[layer].dtype)
        self.ssm[layer][entry] = ssm.float()

    def entry(self, layer: int, entry: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The state kept in ``entry`` for ``layer``."""
        if entry >= self.conv[layer].shape[0]:
            raise KeyError(f"layer {layer}: snapshot entry {entry} was never written")
        return self.conv[layer][entry], self.ssm[layer][entry]

    def _reserve(self, layer: int, entries: int) -> None:
        conv, ssm = self.conv[layer], self.ssm[layer]
        have = conv.shape[0]
        if entries > have:
            n = min(self.num_entries, max(entries, 2 * have))
            with torch.inference_mode(False):  # plain tensors: writable outside inference too
                self.conv[layer] = torch.cat((conv, conv.new_zeros(n - have, *conv.shape[1:])))
                self.ssm[layer] = torch.cat((ssm, ssm.new_zeros(n - have, *ssm.shape[1:])))

    def allocated_bytes(self) -> int:
        tensors = [*self.conv.values(), *self.ssm.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
