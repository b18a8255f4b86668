"""The block-scaled FP8 GEMM (``model/fp8_scale_layout.py``) on this GPU, for shapes of the
4-layer Qwen3-30B-A3B bench: decode and prefill linears, an expert's few rows, and the down
projection's K = 768 (6 column blocks, padded to 8). Each line: the relative error against the
dequantized product (about 0.026: the activations' FP8 rounding), or "refused".

Usage: python scripts/fp8_layout_probe.py   (a GPU)
"""

from __future__ import annotations

import torch

from moe_overlap.model.fp8_scale_layout import gemm_error, gemm_works

SHAPES = ((64, 4096, 2048), (3072, 2048, 4096), (5, 1536, 2048), (5, 2048, 768), (8, 2048, 768))


def main() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    print(
        f"== {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    for rows, n, k in SHAPES:
        error = gemm_error(device, rows, n, k)
        print(f"{rows}x{n}x{k}: " + ("refused" if error is None else f"{error:.4f}"))
    print(f"the engine takes the W8A8 path: {gemm_works(device)}")


if __name__ == "__main__":
    main()
