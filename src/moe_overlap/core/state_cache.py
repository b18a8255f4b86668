"""The recurrent-state cache of linear-attention layers, next to the KV cache.

A Gated DeltaNet layer keeps, per sequence, a conv state (its last ``kernel - 1`` inputs) and
an SSM state (``[value heads, key dim, value dim]``) in place of a KV cache. They live here, in
the row of the sequence's KV cache slot, so a slot's state is allocated, reused and dropped with
the slot.

A state is a running summary, not a log: a piece of a sequence (a prefill chunk, the later half
of a two-chunk cut) can run only on the state after exactly its prefix. The cache records, per
layer and slot, how many tokens its state has absorbed, and ``read`` refuses any other prefix
with a ``StateOrderError``, so an overlap schedule that ran a later piece first fails loudly
instead of computing on a wrong state. A piece at position 0 starts from zeros, whatever the
slot held before (a finished or aborted request's state is never read).

Speculative decoding's verify forward feeds a sequence's last token and its drafts, and the
state absorbs them all, rejected drafts included. So a verify piece also ``keep``s the state
after each of its rows, and the next forward, whose batch carries each sequence's computed
length (the verify's start plus its accepted rows), ``settle``s every kept slot before any
layer reads: the state after exactly the accepted rows, ``absorbed`` set to that count. Kept
states live for that one forward: a slot the next forward does not resume keeps the state after
all its rows, which ``read`` refuses at any shorter prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_overlap.core.state_snapshots import StateSnapshots
from moe_overlap.core.step import PageOps


class StateOrderError(RuntimeError):
    """A piece of a sequence reached a linear-attention layer before the piece before it."""


@dataclass
class KeptStates:
    """One slot's states after each row of its verify pieces: the state after ``start + j``
    tokens (j = 1 .. n) has conv state ``window[:, j : j + kernel - 1]`` (``window``: the
    inputs before and the rows') and SSM state ``ssm[j - 1]``."""

    start: int
    window: torch.Tensor  # [channels, kernel - 1 + n]
    ssm: torch.Tensor  # [n, heads, dk, dv]

    @property
    def end(self) -> int:
        return self.start + self.ssm.shape[0]


class StateCache:
    """Per layer: ``conv [slots, channels, kernel - 1]`` and ``ssm [slots, heads, dk, dv]``,
    grown to the highest slot used (the SSM state in float32 whatever the model's dtype: it
    accumulates over the whole sequence)."""

    def __init__(
        self,
        layers: dict[int, tuple[tuple[int, ...], tuple[int, ...]]],
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        snapshots: int = 0,
    ):
        """``snapshots``: entries kept at cached page boundaries for prefix caching."""
        self.num_slots = num_slots
        self.shapes = layers  # layer -> (conv shape, ssm shape), without the slot dimension
        self.dtype, self.device = dtype, torch.device(device)
        self.conv = {
            i: torch.zeros(0, *c, dtype=dtype, device=device) for i, (c, _) in layers.items()
        }
        self.ssm = {i: torch.zeros(0, *s, device=device) for i, (_, s) in layers.items()}
        self.absorbed: dict[int, dict[int, int]] = {i: {} for i in layers}  # layer -> slot -> n
        self.kept: dict[int, dict[int, KeptStates]] = {i: {} for i in layers}  # verify rows

        self.snapshots = StateSnapshots(layers, snapshots, dtype, device)

    def read(
        self, layer: int, slots: list[int], prefixes: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states sequences ``slots`` start from: zeros at prefix 0, else the state after
        exactly ``prefixes[i]`` tokens (``StateOrderError`` otherwise)."""
        top = max(slots, default=-1) + 1
        if top > self.num_slots:
            raise IndexError(f"slot {top - 1} is outside the state cache's {self.num_slots} slots")
        conv, ssm = self._reserve(layer, top)
        have = self.absorbed[layer]
        for slot, prefix in zip(slots, prefixes, strict=True):
            if prefix and have.get(slot) != prefix:
                raise StateOrderError(
                    f"layer {layer}, slot {slot}: a piece starting at token {prefix} needs the "
                    f"state after {prefix} tokens, but the cache holds the state after "
                    f"{have.get(slot, 0)}; the piece before it must run this layer first"
                )
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        keep = torch.tensor([p > 0 for p in prefixes], dtype=torch.bool, device=self.device)
        return (
            torch.where(keep[:, None, None], conv[index], 0.0),
            torch.where(keep[:, None, None, None], ssm[index], 0.0),
        )

    def write(
        self,
        layer: int,
        slots: list[int],
        lengths: list[int],
        conv: torch.Tensor,
        ssm: torch.Tensor,
    ) -> None:
        """Store the states after ``lengths[i]`` tokens of sequences ``slots``."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.conv[layer][index] = conv.to(self.dtype)
        self.ssm[layer][index] = ssm.float()
        self.absorbed[layer].update(zip(slots, lengths, strict=True))

    def keep(
        self,
        layer: int,
        slots: list[int],
        starts: list[int],
        windows: torch.Tensor,
        ssm: torch.Tensor,
    ) -> None:
        """Keep the states after each row of verify pieces of ``slots`` (``starts``: the tokens
        before each piece; ``windows [B, channels, kernel - 1 + n]``, ``ssm [B, n, ...]``). A
        piece that continues the slot's kept rows (a verify sequence cut in two) extends them."""
        kept = self.kept[layer]
        width = self.shapes[layer][0][-1]
        for i, (slot, start) in enumerate(zip(slots, starts, strict=True)):
            before = kept.get(slot)
            if before is not None and before.end == start:
                window = torch.cat((before.window, windows[i, :, width:]), dim=1)
                kept[slot] = KeptStates(before.start, window, torch.cat((before.ssm, ssm[i])))
            else:
                kept[slot] = KeptStates(start, windows[i], ssm[i])

    def settle(self, slots: list[int], prefixes: list[int]) -> int:
        """Before a forward of sequences ``slots`` at ``prefixes``: each slot kept by the last
        (verify) forward takes the state after its ``prefix`` tokens where that lies inside its
        kept rows (a rejected draft: rolled back) unless something wrote the slot since, and
        every kept state is dropped. Returns the number of slots rolled back."""
        resumes = dict(zip(slots, prefixes, strict=True))
        rolled: set[int] = set()
        for layer, kept in self.kept.items():
            width = self.shapes[layer][0][-1]
            have = self.absorbed[layer]
            back = [  # a slot written since (another sequence's state) is not rolled back
                (slot, resumes[slot] - k.start, k)
                for slot, k in kept.items()
                if k.start < resumes.get(slot, -1) < k.end and have.get(slot) == k.end
            ]
            if back:
                index = torch.tensor([s for s, _, _ in back], device=self.device)
                conv = torch.stack([k.window[:, j : j + width] for _, j, k in back])
                self.conv[layer][index] = conv.to(self.dtype)
                self.ssm[layer][index] = torch.stack([k.ssm[j - 1] for _, j, k in back]).float()
                self.absorbed[layer].update((s, resumes[s]) for s, _, _ in back)
                rolled.update(s for s, _, _ in back)
            kept.clear()
        return len(rolled)

    def apply_snapshots(self, ops: PageOps) -> None:
        """The driver's snapshot changes before a step (after the KV cache's pages): released
        slots' plans dropped, new plans taken, new sequences started from kept states."""
        for slot, entry, tokens in self.snapshots.apply(ops):
            self.restore(slot, entry, tokens)

    def restore(self, slot: int, entry: int, tokens: int) -> None:
        """Start ``slot`` from the states kept in snapshot ``entry``: it has absorbed exactly
        the ``tokens`` tokens of the cached prefix."""
        for layer in self.shapes:
            conv, ssm = self._reserve(layer, slot + 1)
            conv[slot], ssm[slot] = self.snapshots.entry(layer, entry)
            self.absorbed[layer][slot] = tokens

    def _reserve(self, layer: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        conv, ssm = self.conv[layer], self.ssm[layer]
        have = conv.shape[0]
        if slots > have:
            n = min(self.num_slots, max(slots, 2 * have))
            with torch.inference_mode(False):  # plain tensors: writable outside inference too
                conv = torch.cat((conv, conv.new_zeros(n - have, *conv.shape[1:])))
                ssm = torch.cat((ssm, ssm.new_zeros(n - have, *ssm.shape[1:])))
            self.conv[layer], self.ssm[layer] = conv, ssm
        return conv, ssm

    def allocated_bytes(self) -> int:
        tensors = [*self.conv.values(), *self.ssm.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
