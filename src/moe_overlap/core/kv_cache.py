"""A slot-based KV cache: each running sequence owns one row of every layer's buffers."""

from __future__ import annotations

import torch


class KVCache:
    """Per layer, named buffers of shape ``[num_slots, max_len, *entry_shape]``.

    GQA stores ``k`` and ``v``; MLA stores its compressed ``latent`` and rotated ``k_pe``.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        entries: dict[str, tuple[int, ...]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_slots = num_slots
        self.max_len = max_len
        self.layers = [
            {
                name: torch.zeros(num_slots, max_len, *shape, dtype=dtype, device=device)
                for name, shape in entries.items()
            }
            for _ in range(num_layers)
        ]

    def write(self, layer: int, name: str, slot: int, start: int, values: torch.Tensor) -> None:
        end = start + values.shape[0]
        if end > self.max_len:
            raise ValueError(
                f"sequence of {end} tokens exceeds the KV cache's max_len={self.max_len}"
            )
        self.layers[layer][name][slot, start:end] = values

    def read(self, layer: int, name: str, slot: int, length: int) -> torch.Tensor:
        return self.layers[layer][name][slot, :length]

    def extend(
        self, layer: int, slot: int, prefix: int, **new: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Write a sequence's new entries after its ``prefix``; return each entry's whole
        ``[0, prefix + new)`` history, which attention then reads."""
        out = {}
        for name, values in new.items():
            self.write(layer, name, slot, prefix, values)
            out[name] = self.read(layer, name, slot, prefix + values.shape[0])
        return out
