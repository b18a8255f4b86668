"""CUDA streams for communication and for DBO's micro-batches; on CPU every call is a no-op.

On CUDA an async collective runs the way SGLang and DeepEP run it: the communication stream
waits on the compute stream (an event), the collective runs there and a modelled link's delay
beside it (the later ends the transfer), an event is recorded after both, and the consumer's
stream waits on that event. The host never waits in between. On CPU gloo's own threads carry
the collective, and nothing here acts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from moe_overlap.distributed.gpu_wait import hold_stream, sleep_cycles_per_s


class CommStream:
    """One rank's communication stream (one NIC: transfers on it queue in order), and beside it
    the modelled link's stream, whose holds queue in order too."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.link = torch.cuda.Stream(self.device) if on_gpu else None
        self._ready: torch.cuda.Event | None = None  # when the open launch's rows are ready

    @property
    def on_gpu(self) -> bool:
        return self.stream is not None

    @contextmanager
    def launch(self, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Run the block on the communication stream, after what the caller's stream queued, or
        only after ``after`` (an event recorded once the rows were ready: a launch deferred
        past other work the caller's stream queued since must not wait for that work)."""
        if self.stream is None:
            yield
            return
        if after is None:  # ready once what the caller queued so far has run
            after = torch.cuda.current_stream(self.device).record_event()
        self._ready = after
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            yield

    def hold(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``'s memory from reuse until what the communication stream has queued
        when it is freed has run (the caching allocator's ``record_stream``). Call inside
        ``launch`` for every tensor a collective there reads or writes that another stream
        allocated; the output it allocates itself belongs to this stream already."""
        if self.stream is not None and tensor.is_cuda:
            tensor.record_stream(self.stream)

    def delay(self, seconds: float, how: str = "host") -> None:
        """A modelled link's transfer time: the communication stream goes on no sooner than
        ``seconds`` of wall-clock time after this launch's rows were ready, and after the
        link's earlier transfers (its own stream, in order). The hold runs beside a real
        transfer queued in the block, so the later of the two ends it, as on CPU, not their
        sum. Neither the host nor the compute stream waits. ``how``: the hold's way
        (``link.GPU_WAITS``). Call inside ``launch``."""
        if self.stream is None or self.link is None or self._ready is None:
            return
        self.link.wait_event(self._ready)
        with torch.cuda.stream(self.link):
            hold_stream(seconds, self.device, how)
        self.stream.wait_stream(self.link)

    def done(self, timing: bool = False) -> torch.cuda.Event | None:
        """An event after everything queued on the communication stream (None on CPU);
        ``timing``: one that ``elapsed_time`` can read."""
        if self.stream is None:
            return None
        return self.stream.record_event(torch.cuda.Event(enable_timing=timing))

    def cycles_per_s(self) -> float:
        """GPU clock cycles per second of ``torch.cuda._sleep`` (the fallback wait), measured
        once."""
        return sleep_cycles_per_s(self.device)


def consume(event: torch.cuda.Event | None, tensor: torch.Tensor) -> torch.Tensor:
    """Make the caller's stream wait (on the GPU) for ``event`` before it uses ``tensor``, and
    tell the allocator ``tensor`` is used there. Returns ``tensor``; no-op without an event."""
    if event is not None:
        stream = torch.cuda.current_stream(tensor.device)
        stream.wait_event(event)
        tensor.record_stream(stream)
    return tensor


class MicroBatchStreams:
    """DBO on CUDA (vLLM's ``UBatchContext``): each micro-batch launches its compute on its own
    stream; a handover at a yield records an event that the next holder's stream waits on, so
    the GPU runs the segments in baton order, as the host does, while the all-to-alls run on
    the communication stream. ``begin`` and ``end`` join the caller's stream at both ends."""

    def __init__(self, device: torch.device, count: int = 2):
        device = torch.device(device)
        self.device = device
        self.streams = (
            [torch.cuda.Stream(device) for _ in range(count)] if device.type == "cuda" else None
        )
        self._handed: torch.cuda.Event | None = None

    def begin(self) -> None:
        """On the caller's thread: every micro-batch stream starts after the caller's work."""
        if self.streams is not None:
            caller = torch.cuda.current_stream(self.device)
            for s in self.streams:
                s.wait_stream(caller)
            self._handed = None

    @contextmanager
    def on(self, i: int) -> Iterator[None]:
        """Micro-batch ``i``'s thread launches on its own stream inside this block."""
        if self.streams is None:
            yield
            return
        with torch.cuda.stream(self.streams[i]):
            yield

    def hand_over(self, i: int) -> None:
        if self.streams is not None:
            self._handed = self.streams[i].record_event()

    def take_over(self, i: int) -> None:
        if self.streams is not None and self._handed is not None:
            self.streams[i].wait_event(self._handed)

    def end(self) -> None:
        """On the caller's thread: its stream continues after both micro-batches."""
        if self.streams is not None:
            caller = torch.cuda.current_stream(self.device)
            for s in self.streams:
                caller.wait_stream(s)
