"""The forward's copies between host and device.

The forward reads the device once per dispatch (``read_counts``: the all-to-all needs its split
sizes on the host; on CUDA ``CountsRead``, which waits for the counts' copy alone) and nowhere
else; everything else it needs on the host (positions, slots,
bounds) comes from the batch's host metadata, sent with ``to_device``, which never waits.
``tests/runtime/test_host_syncs.py`` holds the forward to that on CPU by running it on ``meta`` tensors.
"""

from __future__ import annotations

import threading

import torch

# set while ``host_values`` reads a host tensor (``tools/host_reads.py`` leaves those out)
READING_HOST = threading.local()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device``: on CUDA through pinned memory, so the host does not wait
    for the copy (a pageable copy synchronises the stream)."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_to(dst: torch.Tensor, t: torch.Tensor) -> None:
    """Host tensor ``t`` into device tensor ``dst`` (a CUDA graph's input buffer), the same way
    as ``to_device``: one copy, and the host does not wait for it."""
    if dst.is_cuda:
        dst.copy_(t.pin_memory(), non_blocking=True)
    else:
        dst.copy_(t)


class CountsRead:
    """A device tensor's read started now and finished by ``wait``: on CUDA a copy into pinned
    memory on a copy stream that waits for an event recorded after what produced the tensor,
    so ``wait`` blocks the host until that copy is done, not until everything queued on the
    compute stream since (``.cpu()`` would drain it). Elsewhere ``read_counts`` at once."""

    _streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, counts: torch.Tensor, total: int):
        self.done: torch.cuda.Event | None = None
        self.ready: torch.cuda.Event | None = None  # CUDA: after what produced ``counts``
        if counts.device.type != "cuda":
            self.host = read_counts(counts, total)
            return
        self.ready = ready = torch.cuda.current_stream(counts.device).record_event()
        stream = self._streams.get(counts.device)
        if stream is None:
            stream = self._streams[counts.device] = torch.cuda.Stream(counts.device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            counts.record_stream(stream)
            self.done = stream.record_event()

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        return self.host


def read_counts(counts: torch.Tensor, total: int) -> torch.Tensor:
    """The one device-to-host read of a dispatch: its rows per expert, on the host. ``total``
    (their sum, known on the host) lets a run without data (``meta`` tensors: the host-sync
    gate, the operation counts of ``tools/device_ops.py``) stand in plausible counts: the rows
    spread evenly over the experts."""
    if counts.device.type == "meta":
        n = counts.numel()
        even = [total // n + (i < total % n) for i in range(n)]
        return torch.tensor(even, dtype=torch.long).view(counts.shape)
    return counts.cpu()


def host_values(t: torch.Tensor) -> list:
    """The values of a tensor that lives on the host, such as a control collective's result (the
    overlap votes go over gloo on CPU tensors, next to NCCL too): no device is waited for. A
    device tensor here is a bug, refused."""
    if t.device.type != "cpu":
        raise ValueError(f"host_values of a {t.device} tensor: that is a read of the device")
    READING_HOST.active = True
    try:
        return t.tolist()
    finally:
        READING_HOST.active = False
