"""The communication stream's wait (a modelled link's transfer time) lasts the asked wall-clock
time, measured by CUDA events, and the host does not wait for it. Each timed wait queues behind
a short one, so the events time the wait and not the host's launch of it."""

from __future__ import annotations

import time

import pytest
import torch

from moe_overlap.distributed import gpu_wait
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
WAITS_S = (0.002, 0.02, 0.2)


def _timed_waits(use_triton: bool) -> list[tuple[float, float, float, bool]]:
    """Per asked wait: (asked, measured by events, host seconds in the call, stream busy after)."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    gpu_wait.hold_stream(1e-4, device, use_triton)  # compiled or calibrated before timing
    torch.cuda.synchronize()
    out = []
    for seconds in WAITS_S:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(stream):
            gpu_wait.hold_stream(0.005, device, use_triton)  # busy while the host launches
            start.record()
            host = time.perf_counter()
            gpu_wait.hold_stream(seconds, device, use_triton)
            host = time.perf_counter() - host
            end.record()
        busy = not end.query()
        end.synchronize()
        out.append((seconds, start.elapsed_time(end) / 1e3, host, busy))
    return out


def test_the_globaltimer_wait_lasts_the_asked_time_and_the_host_does_not_wait():
    if gpu_wait.triton is None:
        pytest.skip("no Triton here: the wait falls back to torch.cuda._sleep")
    for asked, measured, host, busy in _timed_waits(use_triton=True):
        assert abs(measured - asked) <= 0.1 * asked, (asked, measured)
        assert busy and host < 0.1 * asked + 5e-4, (asked, host)  # launched, not waited


def test_the_calibrated_sleep_fallback_is_near_the_asked_time():
    """Looser: SM cycles drift with the clock, which is why the globaltimer wait exists."""
    for asked, measured, host, busy in _timed_waits(use_triton=False):
        assert abs(measured - asked) <= 0.25 * asked, (asked, measured)
        assert busy and host < 0.1 * asked + 5e-4, (asked, host)
