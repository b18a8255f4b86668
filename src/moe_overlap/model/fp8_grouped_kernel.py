"""The Triton kernel behind ``fp8_grouped.py``: one launch for a whole bank of FP8 experts.

Each program computes one ``BLOCK_M x BLOCK_N`` tile of one expert's output. The host gives
it a tile map built on the device (which expert a tile belongs to and its first row), so
nothing is read back and the launch's grid depends only on the shapes: a CUDA graph can hold
it. Along K it walks the 128-wide scale groups: an FP8 dot per group, scaled by the rows'
activation scales (1x128) and the columns' weight scales (128x128), summed in fp32.

Its own module, imported on first use (``fp8_grouped.py``), so that no CPU process imports
Triton. The CPU tests run the same body in Triton's interpreter: with ``TRITON_INTERPRET=1``
set before Triton is imported (``tests/conftest.py`` does where there is no GPU),
``triton.jit`` interprets it on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped(
    x,  # [M, K] FP8 rows, grouped by expert (rows stride_xm apart)
    x_scale,  # [M, K / 128] fp32, any strides
    w,  # [E, N, K] FP8
    w_scale,  # [E, N / 128, >= K / 128] fp32
    out,  # [M, N]
    tile_expert,  # [tiles] int32: the tile's expert, E past the last tile
    tile_row,  # [tiles] int32: the tile's first row
    ends,  # [E] int32: where each expert's rows end
    n,
    k,
    stride_xm,
    stride_xs_m,
    stride_xs_k,
    stride_we,
    stride_wse,
    stride_wsn,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    expert = tl.load(tile_expert + tl.program_id(0))
    if expert < num_experts:
        rows = tl.load(tile_row + tl.program_id(0)) + tl.arange(0, BLOCK_M)
        row_ok = rows < tl.load(ends + expert)
        rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        ks = tl.arange(0, GROUP_K)
        a_at = x + rows[:, None] * stride_xm + ks[None, :]
        b_at = w + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * k + ks[:, None]
        sa_at = x_scale + rows * stride_xs_m
        sb_at = w_scale + expert.to(tl.int64) * stride_wse + (cols // GROUP_K) * stride_wsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for group in range(0, k // GROUP_K):
            a = tl.load(a_at, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_at, mask=col_ok[None, :], other=0.0)
            sa = tl.load(sa_at + group * stride_xs_k, mask=row_ok, other=0.0)
            sb = tl.load(sb_at + group, mask=col_ok, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            a_at += GROUP_K
            b_at += GROUP_K
        where = out + rows[:, None] * n + cols[None, :]
        tl.store(where, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
