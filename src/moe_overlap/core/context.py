"""The state of one micro-batch as it moves through a model's operations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moe_overlap.core import tracks
from moe_overlap.core.attention_plan import AttentionPlan
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.dispatcher import Dispatcher
from moe_overlap.core.kv_cache import KVCache
from moe_overlap.core.state_cache import StateCache
from moe_overlap.core.timeline import Timeline
from moe_overlap.core.transfer import to_device


class StrictState:
    """A dict that refuses to overwrite a key; ops ``put`` what later ops ``pop``."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}

    def put(self, **items: Any) -> None:
        for key, value in items.items():
            if key in self._items:
                raise KeyError(f"state already holds {key!r}; an op would overwrite it")
            self._items[key] = value

    def pop(self, key: str) -> Any:
        if key not in self._items:
            raise KeyError(f"state has no {key!r}; an op ran before the one that makes it")
        return self._items.pop(key)

    def get(self, key: str) -> Any:
        return self._items[key]

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def assert_empty(self, where: str) -> None:
        if self._items:
            raise AssertionError(f"state leaks {sorted(self._items)} past {where}")


@dataclass
class ForwardContext:
    """Everything one micro-batch's ops need besides the weights; passed in, never global."""

    batch: ForwardBatch
    kv_cache: KVCache
    dispatcher: Dispatcher
    positions: torch.Tensor = field(init=False)  # on the device, once per forward
    name: str = tracks.FIRST  # the micro-batch: names its spans and its all-to-alls in the timeline
    timeline: Timeline | None = None
    state: StrictState = field(default_factory=StrictState)
    # how attention runs over this batch: built by the first attention layer, reused by the rest
    attention_plan: AttentionPlan | None = None
    states: StateCache | None = None  # linear-attention layers' recurrent states (Qwen3.5)
    input_ids: torch.Tensor = field(init=False)  # the batch's ids on the device
    # RoPE's cos and sin at this batch's positions, per table and dtype: looked up by the first
    # layer that rotates, reused by the rest (model/layers.py: RotaryEmbedding.rows)
    rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the batch is host metadata; the cache sits on the device. Bounds come from the host
        # lists, so nothing reads the device for them
        staged = self.batch.device_inputs
        if staged is not None:  # a CUDA graph's buffers: bounds cover any batch they hold
            self.positions, self.input_ids = staged.positions, staged.input_ids
            self.position_end, self.slot_end = staged.max_len, self.kv_cache.num_slots
            return
        self.kv_cache.reserve(self.batch.slots, self.batch.seq_lens)  # pages as they grow
        device = self.kv_cache.device
        self.positions = to_device(self.batch.positions, device)
        self.input_ids = to_device(self.batch.input_ids, device)
        self.position_end = max(self.batch.seq_lens, default=0)  # RoPE and cache length bound
        self.slot_end = max(self.batch.slots, default=-1) + 1  # the cache's slot bound
