"""``--moe-dispatch-dtype``: the form the dispatch's rows take on the wire.

``auto`` sends the run dtype's rows as they are (``PlainRows``). ``fp8`` (``Fp8Rows``) sends
each row as ``float8_e4m3fn`` values with one float32 scale per group of ``group`` columns,
the 1x128 per-token-group quantization of SGLang, vLLM and DeepEP (``scale = amax / 448``).
The group is ``min(128, hidden)`` columns (a tiny model's row is one group); a width that 128
does not divide ends in a shorter group. A row travels as one byte buffer: its ``hidden``
FP8 bytes, then its scales' bytes, padded to whole 4-byte words (the low-latency dispatch bit-
casts its header row to int32), so a row's scales cannot part from it in any split of the
rows, and the all-to-all's byte count (what a modelled link charges) is that buffer's.

The experts read the rows as they arrived: W8A8 experts on a GPU take the FP8 values and
scales straight into their grouped kernel (``model/fp8_grouped.py``, as DeepEP's rows feed
DeepGEMM: no decode, no second quantization), every other path decodes them to the run dtype
(``decode``; the CPU has no FP8 GEMM). The combine sends the experts' outputs in the run dtype.
The one-process run encodes the rows where they would be sent (``dispatch/local.py``), so every
layout and overlap mode gives its experts the same bytes.

On a GPU, rows of whole 128-wide groups encode and decode in one Triton pass each, straight
into and out of the wire's bytes (``fp8_wire_kernels.py``), with the torch operations' bits;
``one_pass`` checks those bits once per device and keeps the torch operations where they differ.
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType

import torch
import torch.nn.functional as F

from moe_overlap.core.a2a_mode import DispatchDtype
from moe_overlap.core.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
GROUP = 128  # columns per scale (DeepSeek-V3's and the references' 1x128)
SCALE_BYTES = 4  # a float32 scale
ROWS_PER_PROGRAM = 32  # rows per program of the one-pass kernels
log = logging.getLogger(__name__)


class PlainRows:
    """Rows in the run dtype: nothing changes on the way."""

    fp8 = False

    def encode(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def empty_decoded(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(rows)


class Fp8Rows(PlainRows):
    """Rows of ``hidden`` values as FP8 bytes plus per-group scales, decoded to ``dtype``."""

    fp8 = True

    def __init__(self, hidden: int, dtype: torch.dtype):
        if hidden < 1:
            raise ValueError(f"hidden={hidden} must be >= 1")
        self.hidden, self.dtype = hidden, dtype
        self.group = min(GROUP, hidden)
        self.groups = math.ceil(hidden / self.group)
        self.scales_end = hidden + SCALE_BYTES * self.groups  # a row's bytes before padding
        self.width = -(-self.scales_end // SCALE_BYTES) * SCALE_BYTES  # bytes per row on the wire

    def encode(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` in any float dtype -> ``[n, width]`` uint8."""
        if self._one_pass(hidden):
            return self.encode_in_one_pass(hidden)
        q, scales = quantize(hidden, self.group)
        n = hidden.shape[0]
        out = hidden.new_zeros((n, self.width), dtype=torch.uint8)
        out[:, : self.hidden] = q.view(torch.uint8)
        end = self.scales_end
        out[:, self.hidden : end] = scales.reshape(-1).view(torch.uint8).view(n, end - self.hidden)
        return out

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """``[..., width]`` uint8 -> ``[..., hidden]`` in the run dtype."""
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, self.width)
        if self._one_pass(flat):
            return self.decode_in_one_pass(flat).view(*lead, self.hidden)
        q = flat[:, : self.hidden].contiguous().view(FP8)
        scales = (
            flat[:, self.hidden : self.scales_end]
            .reshape(-1)
            .view(torch.float32)
            .view(-1, self.groups)
        )
        return dequantize(q, scales, self.group).to(self.dtype).view(*lead, self.hidden)

    def empty_decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """Room for ``decode(rows)``."""
        return rows.new_empty((*rows.shape[:-1], self.hidden), dtype=self.dtype)

    def _one_pass(self, t: torch.Tensor) -> bool:
        whole = self.group == GROUP and self.hidden % GROUP == 0
        return whole and t.is_cuda and one_pass(t.device)

    def parts(self, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 values ``[n, hidden]`` and float32 scales ``[n, groups]`` of ``[n, width]``
        wire rows, as views of their bytes (rows ``width`` bytes apart)."""
        scales = wire[:, self.hidden : self.scales_end]
        return wire[:, : self.hidden].view(FP8), scales.view(torch.float32)

    def encode_in_one_pass(self, hidden: torch.Tensor) -> torch.Tensor:
        """``encode`` as one kernel writing the wire's bytes (whole 128-wide groups)."""
        out = hidden.new_empty((hidden.shape[0], self.width), dtype=torch.uint8)
        out[:, self.scales_end :] = 0  # the padding to whole words
        quantize_into(hidden, *self.parts(out))
        return out

    def decode_in_one_pass(self, wire: torch.Tensor) -> torch.Tensor:
        """``decode`` of ``[n, width]`` rows as one kernel (whole 128-wide groups)."""
        out = wire.new_empty((wire.shape[0], self.hidden), dtype=self.dtype)
        dequantize_into(*self.parts(wire), out)
        return out


def quantize(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group of ``group`` columns: ``scale = amax / 448`` (0 for an all-zero group,
    whose values stay 0) and ``q = x / scale`` in ``float8_e4m3fn``. Returns ``q`` ``[n,
    hidden]`` and the float32 scales ``[n, ceil(hidden / group)]``."""
    n, hidden = x.shape
    groups = math.ceil(hidden / group)
    padded = F.pad(x.float(), (0, groups * group - hidden)).view(n, groups, group)
    # 448 as a tensor on x's device (filled there: no copy from the host): CUDA divides by a
    # Python number as a multiply by its reciprocal, a bit off at times from the division CPU
    # and the one-pass kernel round
    scales = padded.abs().amax(dim=-1) / padded.new_full((), FP8_MAX)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (padded / safe.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(n, groups * group)[:, :hidden], scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """``q * scale`` per group, in float32: ``[n, hidden]``."""
    n, hidden = q.shape
    groups = scales.shape[1]
    padded = F.pad(q.float(), (0, groups * group - hidden)).view(n, groups, group)
    return (padded * scales.unsqueeze(-1)).view(n, groups * group)[:, :hidden]


@functools.cache
def wire_kernels() -> ModuleType | None:
    """``fp8_wire_kernels`` (Triton), imported on first use; None without Triton."""
    try:
        import moe_overlap.dispatch.fp8_wire_kernels as module
    except ImportError:
        return None
    return module


def quantize_into(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """``quantize(x, 128)`` as one kernel, into ``q`` ``[M', K]`` (FP8, rows any distance
    apart; rows past x's are zeros) and ``scale`` ``[M', K / 128]`` (any strides)."""
    module = wire_kernels()
    if module is None:
        raise NotImplementedError("Triton is not installed: no one-pass FP8 quantization")
    m, k = x.shape
    rows = q.shape[0]
    module.quantize[(-(-rows // ROWS_PER_PROGRAM), k // GROUP)](
        x.contiguous(),
        q,
        scale,
        m,
        rows,
        k,
        q.stride(0),
        *scale.stride(),
        BLOCK_M=ROWS_PER_PROGRAM,
        GROUP_K=GROUP,
    )


def dequantize_into(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``dequantize(q, scale, 128)`` cast to ``out``'s dtype (contiguous), as one kernel."""
    module = wire_kernels()
    if module is None:
        raise NotImplementedError("Triton is not installed: no one-pass FP8 dequantization")
    m, k = q.shape
    module.dequantize[(-(-m // ROWS_PER_PROGRAM), k // GROUP)](
        q,
        scale,
        out,
        m,
        k,
        q.stride(0),
        *scale.stride(),
        BLOCK_M=ROWS_PER_PROGRAM,
        GROUP_K=GROUP,
        TO_BF16=out.dtype == torch.bfloat16,
    )


@functools.cache
def one_pass(device: torch.device) -> bool:
    """Whether the one-pass kernels run on ``device`` (a GPU) with the torch operations' bits,
    checked once (``kernels_match``, which reads the device): at W8A8's load (``gemm_works``)
    or at the first FP8 encode, an eager forward's (a decode graph's warm-up runs eagerly
    before its capture)."""
    return device.type == "cuda" and kernels_match(device)


def kernels_match(device: torch.device) -> bool:
    """Whether ``quantize_into`` and ``dequantize_into`` give ``quantize``'s and
    ``dequantize``'s bits on ``device``: rows across twelve orders of magnitude, one all
    zeros, in bf16 and float32."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(7, 384, generator=gen) * torch.logspace(-6, 6, 7)[:, None]
    x[3] = 0
    try:
        for dtype in (torch.bfloat16, torch.float32):
            rows = Fp8Rows(384, dtype)
            wire = rows.encode_in_one_pass(x.to(device, dtype))
            theirs = rows.encode(x.to(dtype))  # on CPU: the torch operations
            decoded = rows.decode_in_one_pass(wire)
            expected = rows.decode(theirs).to(device)
            if not (torch.equal(wire, theirs.to(device)) and torch.equal(decoded, expected)):
                log.warning("the one-pass FP8 kernels differ from torch's on %s", device)
                return False
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        log.warning("the one-pass FP8 kernels are unavailable on %s (%s)", device, exc)
        return False
    return True


def dispatch_rows(dispatch_dtype: str, hidden: int, dtype: torch.dtype) -> PlainRows:
    """The wire form ``--moe-dispatch-dtype`` names, for rows of ``hidden`` values in ``dtype``."""
    if dispatch_dtype == DispatchDtype.FP8:
        return Fp8Rows(hidden, dtype)
    if dispatch_dtype == DispatchDtype.AUTO:
        return PlainRows()
    raise ConfigError(
        f"--moe-dispatch-dtype={dispatch_dtype!r} must be one of {', '.join(DispatchDtype)}"
    )
