"""A one-program Triton kernel that spins on PTX ``%globaltimer`` for a number of nanoseconds:
``gpu_wait.py``'s ``globaltimer`` wait. Its own module, imported on first use, so that no CPU
process pays for importing Triton (a quarter of a second)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit(do_not_specialize=["duration_ns"])  # one compile, not one per alignment
def spin(duration_ns):
    start = _now()
    now = start
    while now - start < duration_ns:
        now = _now()
