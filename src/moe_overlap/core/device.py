"""Where a rank computes (``--device cpu|cuda|auto``), in which precision (``--dtype``), and
the torch.distributed backend that follows from it; each bad request is one clear error."""

from __future__ import annotations

import os
from typing import Any

import torch

from moe_overlap.core.errors import ConfigError

DEVICES = ("cpu", "cuda", "auto")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE_HELP = (
    "where ranks compute: cpu (gloo), cuda (rank i on cuda:<local rank i>, NCCL for the data "
    "plane, gloo for control), or auto (cuda when every rank on this machine gets its own GPU, "
    "else cpu)"
)
AUTO_DTYPE = "auto"
DTYPE_CHOICES = (AUTO_DTYPE, *DTYPES)
DTYPE_HELP = (
    "weights and KV cache (routers stay float32): float32 (exact), bfloat16, or auto: on a "
    "GPU the checkpoint's (or --hf-config's) torch_dtype, bfloat16 for every Hub MoE "
    "(bfloat16 for float16, which is not served; float32 where it names none, as for seeded "
    "weights), and on CPU float32"
)


def ranks_on_this_node(world_size: int) -> int:
    """Ranks that share this machine's GPUs: torchrun's ``LOCAL_WORLD_SIZE``, else all of them
    (spawned ranks all run here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def resolve_device(requested: str, ranks_here: int) -> str:
    """``"cpu"`` or ``"cuda"``. ``auto`` is CUDA only when every rank on this machine gets a
    GPU of its own (NCCL will not put two ranks of one communicator on one GPU)."""
    if requested not in DEVICES:
        raise ConfigError(f"--device={requested!r} must be one of {', '.join(DEVICES)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return "cuda" if gpus >= ranks_here else "cpu"
    if requested == "cuda" and gpus == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(
            f"--device cuda: no CUDA device is visible here (torch {torch.__version__}, {build});"
            " use --device cpu, or --device auto to take a GPU only where there is one"
        )
    if requested == "cuda" and gpus < ranks_here:
        raise ConfigError(
            f"--device cuda needs one GPU per rank: {ranks_here} ranks on this machine but "
            f"{gpus} GPU(s) visible; use fewer ranks (--ep/--tp) or --device cpu"
        )
    return requested


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype a Hugging Face ``config.json`` names (``dtype``, or the older ``torch_dtype``;
    a multimodal checkpoint's text part's), or None."""
    text = raw.get("text_config")
    for where in (raw, text if isinstance(text, dict) else {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(where.get(key), str):
                return where[key]
    return None


def resolve_dtype(requested: str, device: str, checkpoint: str | None = None) -> str:
    """``--dtype``'s name: ``auto`` is float32 on CPU and, on a GPU, the ``checkpoint``'s dtype
    where it is one of ``DTYPES``, bfloat16 for another (float16), float32 for none."""
    if requested not in DTYPE_CHOICES:
        raise ConfigError(
            f"--dtype={requested!r} must be one of {', '.join(DTYPE_CHOICES)} (auto: the "
            "checkpoint's on a GPU, float32 on CPU)"
        )
    if requested != AUTO_DTYPE:
        return requested
    if device != "cuda":
        return "float32"
    if checkpoint is None:
        return "float32"
    return checkpoint if checkpoint in DTYPES else "bfloat16"


def torch_dtype(name: str) -> torch.dtype:
    """The weights' and KV cache's dtype; float32 is the exactness reference."""
    if name not in DTYPES:
        raise ConfigError(f"--dtype={name!r} must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def local_rank(global_rank: int) -> int:
    """This rank's index on its machine: torchrun's ``LOCAL_RANK``, else the global rank."""
    return int(os.environ.get("LOCAL_RANK", global_rank))


def rank_device(device: str, local_rank: int) -> torch.device:
    """This rank's device: ``cuda:<local rank>``, or the CPU."""
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} must be cpu or cuda (resolve_device settles auto)")
    return torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu")


def dist_backend(device: str) -> str:
    """gloo on CPU; on CUDA, NCCL for CUDA tensors (the data plane) and gloo for CPU tensors
    (control: the overlap votes, the batch metadata), in one process group each."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
