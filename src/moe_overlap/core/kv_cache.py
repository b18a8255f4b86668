"""A slot-based KV cache: each running sequence owns one row of every layer's buffers."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch


class KVCache:
    """Per layer, named buffers of shape ``[num_slots, max_len, *entry_shape]`` (the same
    entries in every layer, or each layer's own).

    GQA stores ``k`` and ``v``; MLA stores its compressed ``latent`` and rotated ``k_pe``.
    The buffers grow (zero-filled) to the highest slot and the longest sequence written so far,
    so memory follows the sequences actually running, never more than ``num_slots x max_len``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        entries: dict[str, tuple[int, ...]] | Sequence[dict[str, tuple[int, ...]]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = torch.device(device)  # where a forward's index tensors must live
        self.dtype = dtype
        # PD multiplexing stores from two threads: a buffer may grow (be replaced) under one
        # while the other writes, so writes and growth take turns
        self._lock = threading.Lock()
        # one dict: every layer's entries; a sequence: each layer's own (MiMo's sliding layers
        # have more KV heads than its full ones)
        per_layer = [entries] * num_layers if isinstance(entries, dict) else list(entries)
        self.layers = [
            {
                name: torch.zeros(0, 0, *shape, dtype=dtype, device=device)
                for name, shape in layer.items()
            }
            for layer in per_layer
        ]

    def store(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        bounds: tuple[int, int] | None = None,
        **new: torch.Tensor,
    ) -> None:
        """Write each new token's entries at ``(slots[i], positions[i])`` (one call per entry).
        ``bounds``: (the highest position, the highest slot) + 1, from the host's metadata; the
        forward passes them, since reading them from device tensors would wait for the device."""
        if slots.numel() == 0:
            return
        if bounds is None:
            bounds = int(positions.max()) + 1, int(slots.max()) + 1
        end, top = bounds
        if end > self.max_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds the KV cache's max_len={self.max_len}"
            )
        if top > self.num_slots:
            raise IndexError(f"slot {top - 1} is outside the KV cache's {self.num_slots} slots")
        buffers = self.layers[layer]
        with self._lock:
            for name, values in new.items():
                buf = self._reserve(buffers, name, top, end)
                buf[slots, positions] = values

    def gather(
        self, layer: int, name: str, slots: torch.Tensor | slice, length: int, start: int = 0
    ) -> torch.Tensor:
        """Entries ``[start, length)`` of several sequences, ``[num_slots, length - start,
        ...]`` (a copy, or a view for a slice of slots); rows past a sequence's own length hold
        zeros or stale finite values, to be masked."""
        return self.layers[layer][name][slots, start:length]

    def allocate_all(self) -> None:
        """Every buffer at its full ``num_slots x max_len`` now, so none moves later (a CUDA
        graph holds their addresses)."""
        with self._lock:
            for buffers in self.layers:
                for name in buffers:
                    self._reserve(buffers, name, self.num_slots, self.max_len)

    def _reserve(self, buffers: dict, name: str, slots: int, length: int) -> torch.Tensor:
        buf = buffers[name]
        have_slots, have_len = buf.shape[0], buf.shape[1]
        if slots <= have_slots and length <= have_len:
            return buf
        # grow geometrically so a decode step rarely copies the cache
        new_slots = (
            min(self.num_slots, max(slots, 2 * have_slots)) if slots > have_slots else have_slots
        )
        new_len = (
            min(self.max_len, max(length, 2 * have_len, 64)) if length > have_len else have_len
        )
        with torch.inference_mode(False):  # a plain tensor: writable outside inference too
            grown = buf.new_zeros(new_slots, new_len, *buf.shape[2:])
            grown[:have_slots, :have_len] = buf
        buffers[name] = grown
        return grown

    def allocated_bytes(self) -> int:
        """Bytes the buffers hold now (they grow with the running sequences)."""
        return sum(b.numel() * b.element_size() for layer in self.layers for b in layer.values())
