"""The state of one micro-batch as it moves through a model's operations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_overlap.engine.forward_batch import ForwardBatch
from moe_overlap.engine.kv_cache import KVCache


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

    def keys(self) -> list[str]:
        return list(self._items)

    def assert_empty(self, where: str) -> None:
        if self._items:
            raise AssertionError(f"state leaks {sorted(self._items)} past {where}")


@dataclass
class ForwardContext:
    """Everything one micro-batch's ops need besides the weights; passed in, never global."""

    batch: ForwardBatch
    kv_cache: KVCache
    dispatcher: Any  # moe.dispatch.TokenDispatcher
    positions: Any = None  # torch.Tensor, computed once per forward
    name: str = "mb0"
    timeline: Any = None  # moe_overlap.timeline.Timeline, when recording
    state: StrictState = field(default_factory=StrictState)

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = self.batch.positions
