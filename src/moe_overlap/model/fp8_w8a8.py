"""W8A8 block FP8 on a GPU: a linear's FP8 weight times its input quantized per token in
groups of 128 (``scale = amax / 448``, as SGLang and vLLM do), as one ``F.scaled_mm``
with block scales (the input 1x128, the weight 128x128; cuBLAS on sm90 and later).

Taken only on CUDA with compute capability 9.0 or more, a torch that has ``F.scaled_mm``, a
checkpoint in 128x128 blocks, and a shard that starts on a block; a routed expert bank whose
hidden and intermediate sizes are multiples of 128 runs as one Triton launch per projection
(``fp8_grouped.py``), or where Triton is absent the same GEMM per expert (``W8A8Experts``).
The scales are laid out as this GPU's cuBLAS takes them (``fp8_scale_layout.py``:
``F.scaled_mm`` with the recipes named, the rows and the weight grid's column blocks padded). Everything else (CPU always, the MLA's plain ``nn.Linear``
down-projections) runs the dequantized weight. A GEMM that raises at its first call falls back
to the dequantized weight for good."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from moe_overlap.dispatch.fp8_rows import Fp8Rows
from moe_overlap.model.fp8_grouped import grouped_fp8, grouped_fp8_rows, grouped_works, tile_map
from moe_overlap.model.fp8_scale_layout import gemm_works, pad_grid, scaled_mm

W8A8_BLOCK = (128, 128)
log = logging.getLogger(__name__)


def w8a8_available(device: torch.device | str) -> bool:
    """Whether ``device`` runs block-scaled FP8 GEMMs (never on CPU)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    capable = torch.cuda.get_device_capability(device) >= (9, 0)
    return capable and hasattr(nn.functional, "scaled_mm")


class W8A8Linear(nn.Module):
    """``x W^T (+ bias)`` with ``W = q * grid`` in 128x128 blocks, as one scaled GEMM; ``dequantized``
    gives the weight for the fallback."""

    grid: torch.Tensor

    def __init__(
        self, q: torch.Tensor, grid: torch.Tensor, dequantized: Callable[[], torch.Tensor]
    ):
        super().__init__()
        self.q = q  # shared with the parametrization's FP8 tensor: no second copy
        self.register_buffer("grid", pad_grid(grid))  # its column blocks padded to 4
        self.dequantized = dequantized  # () -> the weight in the run dtype
        self.failed = False

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not self.failed:
            try:
                return self._scaled(x, bias)
            except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel not here
                self.failed = True
                log.warning("W8A8 GEMM unavailable (%s); dequantizing this weight instead", exc)
        return nn.functional.linear(x, self.dequantized(), bias)

    def _scaled(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        _check_gemm(x.device)
        y = scaled_mm(x.reshape(-1, x.shape[-1]), self.q, self.grid, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _check_gemm(device: torch.device) -> None:
    """Raise where the block-scaled GEMM fails its check on ``device``
    (``fp8_scale_layout.gemm_works``): the callers then dequantize."""
    if not gemm_works(device):
        raise NotImplementedError(f"no block-scaled FP8 GEMM that checks out on {device}")


class W8A8Experts:
    """A routed expert bank's two projections as W8A8 (``q [E, N, K]``, ``grid [E, N / 128,
    K / 128]`` each): one Triton launch per projection over the whole bank where Triton runs
    and checks out (``fp8_grouped.py``; ``grouped``), else one scaled GEMM per expert and
    projection. ``run`` returns False (and the bank runs its dequantized path, now and after)
    where a GEMM raises."""

    def __init__(
        self, gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]
    ):
        # the FP8 tensors are the bank's own; the grids' column blocks padded to 4
        self.gate_up, self.down = ((q, pad_grid(grid)) for q, grid in (gate_up, down))
        self.grouped = grouped_works(gate_up[0].device)
        self.failed = False

    def run_grouped(
        self,
        x: torch.Tensor,
        ends: torch.Tensor,
        experts: range,
        act: Callable[[torch.Tensor], torch.Tensor],
        wire: Fp8Rows | None = None,
    ) -> torch.Tensor | None:
        """The outputs of ``experts``' rows ``x`` (expert ``experts[i]``'s end at ``ends[i]``,
        int32 on the device), two launches and no host read; None (and the per-expert GEMMs
        from now on) where the kernel raises. ``wire``: ``x`` holds the FP8 dispatch's rows
        as they arrived, whose values and scales the first projection takes as they are."""
        if not self.grouped:
            return None
        block = slice(experts.start, experts.stop)
        gate_up = self.gate_up[0][block], self.gate_up[1][block]
        down = self.down[0][block], self.down[1][block]
        try:
            tiles = tile_map(ends, x.shape[0])  # both projections' rows: one map
            if wire is None:
                h = grouped_fp8(x, ends, *gate_up, tiles)
            else:
                h = grouped_fp8_rows(*wire.parts(x), wire.dtype, ends, *gate_up, tiles)
            return grouped_fp8(act(h), ends, *down, tiles)
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel not here
            self.grouped = False
            log.warning("grouped FP8 expert kernel unavailable (%s); one GEMM per expert", exc)
            return None

    def run(
        self,
        x: torch.Tensor,
        ends: list[int],
        out: torch.Tensor,
        experts: range,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> bool:
        """Write the rows of ``experts`` (expert e's rows are ``ends[e]:ends[e + 1]``) into
        ``out``, one scaled GEMM per expert and projection (where ``run_grouped`` does not
        run); False, with nothing promised in ``out``, where the GEMM is not available."""
        if self.failed:
            return False
        try:
            _check_gemm(x.device)
            for e in experts:
                rows = slice(ends[e], ends[e + 1])
                if rows.start < rows.stop:
                    h = scaled_mm(x[rows], self.gate_up[0][e], self.gate_up[1][e])
                    out[rows] = scaled_mm(act(h), self.down[0][e], self.down[1][e])
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # a kernel not here
            self.failed = True
            log.warning("W8A8 expert GEMM unavailable (%s); dequantizing the experts instead", exc)
            return False
        return True


def experts_fit(hidden: int, intermediate: int, inter_start: int, block: tuple | None) -> bool:
    """An expert bank W8A8 runs: 128x128 blocks, both projections' K multiples of 128 and
    its moe-TP rows starting on a block (the gate and up halves each whole blocks)."""
    return block == W8A8_BLOCK and not (hidden % 128 or intermediate % 128 or inter_start % 128)


def w8a8_fits(weight: torch.Tensor, block: tuple[int, int], starts: tuple[int, int]) -> bool:
    """A 2-D weight this path can run: 128x128 blocks, K a multiple of 128, and this rank's
    shard starting on a block in both dimensions."""
    return (
        weight.dim() == 2
        and block == W8A8_BLOCK
        and weight.shape[1] % 128 == 0
        and all(s % 128 == 0 for s in starts)
    )
