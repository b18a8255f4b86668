"""Hold a CUDA stream for a span of wall-clock time: a modelled link's transfer time.

A one-program Triton kernel spins on PTX ``%globaltimer`` (nanoseconds, the same clock on
every SM, independent of the SM clock's boost and throttling) until the asked time has passed
since it started. Where Triton is missing, ``torch.cuda._sleep`` spins for a number of SM
cycles calibrated once against CUDA events, which drifts when the clock changes.
"""

from __future__ import annotations

import torch

try:  # CUDA builds of torch ship Triton; CPU builds do not, and never call hold_stream
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_SLEEP_PROBE_CYCLES = 20_000_000
_SLEEP_WARM_CYCLES = 100_000_000  # an idle GPU's clock is low: boost it before the probe
_cycles_per_s: dict[int, float] = {}  # per device: torch.cuda._sleep's cycles per second

if triton is not None:

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit(do_not_specialize=["duration_ns"])  # one compile, not one per alignment
    def _spin(duration_ns):
        start = _now()
        now = start
        while now - start < duration_ns:
            now = _now()


def hold_stream(seconds: float, device: torch.device, use_triton: bool = True) -> None:
    """Queue on ``device``'s current stream a wait of ``seconds`` of wall-clock time, counted
    from when the stream reaches it; neither the host nor other streams wait. One program
    spinning on ``%globaltimer`` (Triton), or with ``use_triton=False`` or without Triton a
    calibrated ``torch.cuda._sleep``. Checked on a GPU by ``tests/gpu/test_stream_wait.py``."""
    if seconds <= 0:
        return
    if triton is not None and use_triton:
        with torch.cuda.device(device):
            _spin[(1,)](int(seconds * 1e9), num_warps=1)
        return
    torch.cuda._sleep(int(seconds * sleep_cycles_per_s(device)))


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
