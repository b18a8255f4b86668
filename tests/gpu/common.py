"""What the CUDA checks share: how many GPUs there are, and the skip marks that say so."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(
    GPUS < 1, reason="no CUDA device here: tests/gpu runs on a machine with GPUs (make gpu-check)"
)
needs_gpus = pytest.mark.skipif(
    GPUS < 2,
    reason=f"{GPUS} GPU(s): NCCL across ranks needs one GPU per rank, two or more",
)
