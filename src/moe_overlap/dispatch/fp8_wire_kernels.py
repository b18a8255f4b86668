"""The 1x128 FP8 quantization and its inverse as one Triton pass each, on a GPU
(``fp8_rows.py``): what the FP8 dispatch's encode and decode and W8A8's activations would
otherwise run as about seven torch operations, with fp32 copies of the rows between them.

The bits are the torch operations' (``fp8_rows.quantize``, ``dequantize`` then the cast): both
divisions rounded as torch rounds them (``div_rn``), and every value rounded to its format's
grid in fp32 with ties to even before the cast, so the cast itself is exact on every target
(Triton's interpreter rounds fp32 to FP8 and to bf16 wrongly otherwise).

Its own module, imported on first use, so that no CPU process imports Triton. The CPU tests
run the same bodies in Triton's interpreter: with ``TRITON_INTERPRET=1`` set before Triton is
imported (``tests/conftest.py`` does where there is no GPU), ``triton.jit`` interprets them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quantize(
    x,  # [M, K] in the run dtype, row-major
    q,  # [M', K] FP8 out, rows ``stride_q_m`` apart (M' >= M: rows past M are zeros)
    scale,  # [M', K / 128] fp32 out, any strides
    m,
    m_out,
    k,
    stride_q_m,
    stride_s_m,
    stride_s_k,
    BLOCK_M: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    """One ``BLOCK_M x 128`` block of rows: ``scale = amax / 448`` per row and group (0 for
    an all-zero group, whose values stay 0), ``q = clamp(x / scale, +-448)``."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP_K + tl.arange(0, GROUP_K)
    ok = rows < m_out
    rows64 = rows.to(tl.int64)[:, None]
    v = tl.load(x + rows64 * k + cols[None, :], mask=(rows < m)[:, None], other=0.0)
    v = v.to(tl.float32)
    s = tl.math.div_rn(tl.max(tl.abs(v), axis=1), 448.0)
    safe = tl.where(s > 0, s, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, safe[:, None]), -448.0), 448.0)
    y = _on_e4m3_grid(y).to(q.dtype.element_ty)
    tl.store(q + rows64 * stride_q_m + cols[None, :], y, mask=ok[:, None])
    tl.store(scale + rows * stride_s_m + tl.program_id(1) * stride_s_k, s, mask=ok)


@triton.jit
def dequantize(
    q,  # [M, K] FP8, rows ``stride_q_m`` apart
    scale,  # [M, K / 128] fp32, any strides
    out,  # [M, K] in the run dtype, row-major
    m,
    k,
    stride_q_m,
    stride_s_m,
    stride_s_k,
    BLOCK_M: tl.constexpr,
    GROUP_K: tl.constexpr,
    TO_BF16: tl.constexpr,
):
    """``out = q * scale`` per row and group, in fp32, then cast to the run dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * GROUP_K + tl.arange(0, GROUP_K)
    ok = rows < m
    rows64 = rows.to(tl.int64)[:, None]
    v = tl.load(q + rows64 * stride_q_m + cols[None, :], mask=ok[:, None], other=0.0)
    s = tl.load(scale + rows * stride_s_m + tl.program_id(1) * stride_s_k, mask=ok, other=0.0)
    y = v.to(tl.float32) * s[:, None]
    if TO_BF16:
        y = _on_bf16_grid(y)
    tl.store(out + rows64 * k + cols[None, :], y.to(out.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _on_e4m3_grid(y):
    """``y`` (fp32, within +-448) rounded to float8_e4m3fn's values, ties to even. Normals
    keep 3 mantissa bits (a carry moves up the exponent); below 2^-6 the step is 2^-9,
    rounded by adding and taking away 2^23."""
    mag = tl.abs(y)
    bits = mag.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576: 0xFFF00000
    normal = kept.to(tl.float32, bitcast=True)
    small = ((mag * 512.0 + 8388608.0) - 8388608.0) * 0.001953125  # x 2^-9, exact
    r = tl.where(mag >= 0.015625, normal, small)
    return tl.where(y < 0, -r, r)


@triton.jit
def _on_bf16_grid(y):
    """``y`` (fp32, finite) rounded to bfloat16's values, ties to even: 7 mantissa bits kept
    (bf16's subnormals are fp32's, so one rule covers every finite value)."""
    bits = y.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
    return kept.to(tl.float32, bitcast=True)
