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


def _timed_waits(how: str) -> list[tuple[float, float, float, bool]]:
    """Per asked wait: (asked, measured by events, host seconds in the call, stream busy after)."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    gpu_wait.hold_stream(1e-4, device, how)  # compiled or calibrated before timing
    torch.cuda.synchronize()
    out = []
    for seconds in WAITS_S:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with torch.cuda.stream(stream):
            gpu_wait.hold_stream(0.005, device, how)  # busy while the host launches
            start.record()
            host = time.perf_counter()
            gpu_wait.hold_stream(seconds, device, how)
            host = time.perf_counter() - host
            end.record()
        busy = not end.query()
        end.synchronize()
        out.append((seconds, start.elapsed_time(end) / 1e3, host, busy))
    return out


@pytest.mark.parametrize("how", ["host", "globaltimer"])
def test_the_wait_lasts_the_asked_time_and_the_host_does_not_wait(how):
    if how == "globaltimer" and gpu_wait._spin_kernel() is None:
        pytest.skip("no Triton here: the wait falls back to torch.cuda._sleep")
    # the host function wakes late by the kernel's timer slack and scheduling: ~0.2 ms
    late = 3e-4 if how == "host" else 0.0
    for asked, measured, host, busy in _timed_waits(how):
        assert -0.1 * asked <= measured - asked <= 0.1 * asked + late, (asked, measured)
        assert busy and host < 0.1 * asked + 5e-4, (asked, host)  # launched, not waited


def test_the_host_function_wait_leaves_every_sm_to_compute():
    """A persistent kernel (torch's grouped GEMM, launched on every SM) on another stream
    takes as long beside the host-function wait as alone; beside the globaltimer spin, which
    holds an SM, it waits for the spin to end."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16)
    w = torch.randn(16, 768, 2048, device=device, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.arange(512, 8193, 512, device=device, dtype=torch.int32)

    def compute_s(how: str | None) -> float:
        side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)
        torch.cuda.synchronize()
        if how is not None:
            with torch.cuda.stream(side):
                gpu_wait.hold_stream(0.05, device, how)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(main)
        for _ in range(20):
            torch._grouped_mm(x, w, offs=offs)
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    compute_s(None)
    alone = compute_s(None)
    beside = compute_s("host")
    assert beside < 1.3 * alone + 1e-3, (alone, beside)
    print(
        f"grouped GEMMs alone {alone * 1e3:.2f} ms, beside the host wait {beside * 1e3:.2f} ms, "
        f"beside the spin {compute_s('globaltimer') * 1e3:.2f} ms"
    )


def test_the_calibrated_sleep_fallback_is_near_the_asked_time():
    """Looser: SM cycles drift with the clock, which is why the globaltimer wait exists."""
    for asked, measured, host, busy in _timed_waits("sleep"):
        assert abs(measured - asked) <= 0.25 * asked, (asked, measured)
        assert busy and host < 0.1 * asked + 5e-4, (asked, host)
