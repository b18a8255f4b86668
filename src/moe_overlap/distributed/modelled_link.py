"""A link that exists only as arithmetic: each transfer completes no sooner than
latency + bytes / bandwidth after it starts, queued behind what is already on the link."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from moe_overlap.distributed.link import LinkSpec


@dataclass
class ModelledLink:
    """One rank's link: delay = latency + bytes / bandwidth, transfers queued in order."""

    bytes_per_s: float
    latency_s: float = 0.0
    gpu_wait: str = "host"  # how a GPU holds its communication stream (link.GPU_WAITS)

    @classmethod
    def from_spec(cls, spec: LinkSpec) -> ModelledLink:
        if spec.kind != "model" or spec.bytes_per_s is None:
            raise ValueError(f"not a model link: {spec.spec!r}")
        return cls(spec.bytes_per_s, spec.latency_s, spec.gpu_wait)

    def __post_init__(self) -> None:
        self._free_at = 0.0  # when this rank's link finishes what is already queued on it
        self._lock = threading.Lock()

    def reserve(self, start_time: float, num_bytes: int) -> float:
        """Queue a transfer issued at `start_time`; return when it completes.

        Transfers in flight at once share the link: each waits for those queued before it, as
        on one NIC, so two micro-batches' all-to-alls cannot both get the full bandwidth.
        """
        with self._lock:
            begin = max(start_time, self._free_at)
            self._free_at = begin + num_bytes / self.bytes_per_s
            return self._free_at + self.latency_s

    def sleep_until(self, end_time: float) -> None:
        remaining = end_time - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
