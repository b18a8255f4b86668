"""Hold a CUDA stream for a span of wall-clock time: a modelled link's transfer time.

Three ways, by what the wait occupies while it holds the stream:

- ``host`` (the default): a host function on the stream (``cuLaunchHostFunc``) that is libc's
  ``usleep``: the driver's callback thread sleeps, the stream waits behind it, and no SM is
  held, as a copy engine or an RDMA NIC moving the rows holds none. No Python runs in it, so
  it never waits for the GIL.
- ``globaltimer``: a one-program Triton kernel spinning on PTX ``%globaltimer`` (nanoseconds,
  independent of the SM clock). It holds one SM for the whole wait, as a communication kernel
  does, and a persistent kernel (a grouped GEMM launched on every SM) cannot finish until it
  ends: the measured overlap is then the SM contention's, not the link's.
- ``sleep``: ``torch.cuda._sleep`` for a number of SM cycles calibrated once against CUDA
  events; drifts when the clock changes, and holds an SM too. The fallback of both.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_SLEEP_PROBE_CYCLES = 20_000_000
_SLEEP_WARM_CYCLES = 100_000_000  # an idle GPU's clock is low: boost it before the probe
_cycles_per_s: dict[int, float] = {}  # per device: torch.cuda._sleep's cycles per second


@functools.cache
def _spin_kernel():
    """``gpu_spin.spin``, imported on first use; None without Triton (CPU builds of torch)."""
    try:
        from moe_overlap.distributed.gpu_spin import spin
    except ImportError:
        return None
    return spin


_USLEEP_MAX_US = 900_000  # usleep may refuse a second or more: longer waits are queued in parts


def hold_stream(seconds: float, device: torch.device, how: str = "host") -> None:
    """Queue on ``device``'s current stream a wait of ``seconds`` of wall-clock time, counted
    from when the stream reaches it; neither the host nor other streams wait. ``how``: one of
    ``link.GPU_WAITS`` (see above; what ``--link model:BANDWIDTH,LATENCY,WAIT`` names); a way
    this machine lacks falls back to ``sleep``. Checked on a GPU by
    ``tests/gpu/test_stream_wait.py``."""
    if seconds <= 0:
        return
    if how == "host" and _host_function_wait(seconds, device):
        return
    spin = _spin_kernel() if how in ("host", "globaltimer") else None
    if spin is not None:
        with torch.cuda.device(device):
            spin[(1,)](int(seconds * 1e9), num_warps=1)
        return
    torch.cuda._sleep(int(seconds * sleep_cycles_per_s(device)))


def _host_function_wait(seconds: float, device: torch.device) -> bool:
    """``usleep`` as a host function on the current stream; False where the driver or libc
    cannot be reached."""
    launch, usleep = _driver_calls()
    if launch is None:
        return False
    stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
    left = round(seconds * 1e6)
    while left > 0:
        part = min(left, _USLEEP_MAX_US)
        if launch(stream, usleep, ctypes.c_void_p(part)) != 0:  # CUresult 0: CUDA_SUCCESS
            raise RuntimeError("cuLaunchHostFunc failed: the stream's wait cannot be queued")
        left -= part
    return True


@functools.cache
def _driver_calls() -> tuple:
    """(cuLaunchHostFunc, usleep's address), found once; (None, None) where either is absent."""
    try:
        cuda, libc = ctypes.CDLL("libcuda.so.1"), ctypes.CDLL(None)
        launch = cuda.cuLaunchHostFunc
        launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        launch.restype = ctypes.c_int
        # usleep(useconds_t) called as void (*)(void *): the argument is the microseconds
        return launch, ctypes.cast(libc.usleep, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None, None


def sleep_cycles_per_s(device: torch.device) -> float:
    """SM cycles per second of ``torch.cuda._sleep`` on ``device``, measured once."""
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _cycles_per_s:
        with torch.cuda.device(device):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda._sleep(_SLEEP_WARM_CYCLES)
            start.record()
            torch.cuda._sleep(_SLEEP_PROBE_CYCLES)
            end.record()
            end.synchronize()
            _cycles_per_s[index] = _SLEEP_PROBE_CYCLES / (start.elapsed_time(end) / 1e3)
    return _cycles_per_s[index]
