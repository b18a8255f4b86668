"""Count the tensor operations that make the host read a tensor's values: on a GPU each one waits
for everything queued before it (the stream drains). Run on CPU they count the same: the code
does not know where its tensors live.

Counted: ``.item()``, ``.tolist()``, ``int()``, ``float()``, ``bool()`` and ``index()`` of a
tensor, ``nonzero`` (and ``argwhere``), indexing with a boolean mask, ``repeat_interleave``
without ``output_size``, and ``.cpu()``/``.numpy()``. Host metadata made from Python lists and
read back counts too, which keeps the measure strict: it is the number a GPU run would pay at
most. The one exception is ``core/transfer.py: host_values``, which refuses any tensor not on
the host (the overlap votes' gloo results).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

from moe_overlap.core.transfer import READING_HOST

_READS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__index__: "index",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.argwhere: "argwhere",
    torch.argwhere: "argwhere",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
}
_INTERLEAVE = (torch.repeat_interleave, torch.Tensor.repeat_interleave)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads:`` ... ``reads.total``, ``reads.by_kind``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _READS.get(func)
        if kind == "cpu" and args and args[0].device.type == "cpu":
            kind = None  # already on the host: a no-op
        if func in _INTERLEAVE and kwargs.get("output_size") is None and _sized_by_data(args):
            kind = "repeat_interleave"
        if func is torch.Tensor.__getitem__ and _has_mask(args[1]):
            kind = "boolean index"
        if kind is not None and not getattr(READING_HOST, "active", False):
            self.by_kind[kind] += 1
        return func(*args, **kwargs)


def _sized_by_data(args) -> bool:
    """``repeat_interleave(t, repeats)`` with tensor repeats (its output's size is their sum)."""
    repeats = args[1] if len(args) > 1 else args[0]
    return isinstance(repeats, torch.Tensor) and repeats.numel() > 1


def _has_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
