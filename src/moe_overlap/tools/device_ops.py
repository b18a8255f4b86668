"""Count the device operations a forward issues, on a machine without a GPU.

An eager forward on a GPU is bound by its host: each operation costs a kernel launch of a few
microseconds, however little work the kernel does. How many operations a forward issues is
therefore what its host time follows, and it can be counted anywhere: the model runs on
``meta`` tensors (shapes, no data), and every operation that reads or writes one is counted,
except views, allocations and conversions that return their input (none launches a kernel).
The forward runs under ``inference_mode``, as the engine's does, so a composite operation
(``rms_norm``, ``linear``, ``scaled_dot_product_attention``) counts once, as the fused call it
is on CUDA (one kernel, or two for the norm), not as the steps its CPU fallback takes.

In bf16 the experts run as the grouped GEMM an sm90+ GPU runs (``model/expert_paths.py: grouped_fits``
takes ``meta`` for such a GPU); in fp32 as the padded batched matmul or the loop of other
devices. Only the calling thread's operations are counted: DBO's micro-batches run on threads
of their own.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.runtime.model_runner import ModelRunner
from moe_overlap.runtime.rank import assemble_rank, one_process_groups

_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def _is_meta(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


class DeviceOpCounter(TorchDispatchMode):
    """Counts, by aten name, the operations that touch a ``meta`` tensor and would launch a
    kernel on a GPU. Host metadata (CPU tensors) is not counted; its copy to the device is."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = [*args, *kwargs.values()]
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        if name in _ALLOCATIONS or not any(_is_meta(t) for t in inputs + outputs):
            return out
        if not func._schema.is_mutable and _aliases(outputs, inputs):
            return out  # a view, or a conversion to what the tensor already is
        self.ops[name] += 1
        return out


def _aliases(outputs: list, inputs: list) -> bool:
    """Whether an output shares its input's memory (``reshape`` and ``to`` may or may not)."""
    # under inference_mode views keep no ``_base``; the storages still tell
    same = torch._C._is_alias_of  # type: ignore[attr-defined]
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    return any(isinstance(o, torch.Tensor) and any(same(o, t) for t in tensors) for o in outputs)


def meta_runner(
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    max_len: int = 1024,
    seqs: int = 64,
    emulate_peers: int = 0,
) -> ModelRunner:
    """A one-process runner of ``cfg`` built on ``meta`` tensors: no weight or cache memory
    at all, so a full-size model counts as cheaply as a tiny one. ``emulate_peers`` N: rank 0
    of ep=N with its peers emulated, as ``bench --emulate-peers`` runs it. It is assembled as
    every rank is (``runtime/rank.py: assemble_rank``), on ``meta``."""
    spec = EngineSpec(
        cfg,
        max_num_seqs=seqs,
        max_len=max_len,
        kv_cache_bytes=sys.maxsize,  # meta tensors take no memory: every slot at max_len
        emulate_peers=emulate_peers,
        dtype=dtype,
    )
    meta = torch.device("meta")
    return assemble_rank(spec, one_process_groups(emulate_peers, meta, None), meta)


def count_forward(
    runner: ModelRunner, batch: ForwardBatch, overlap: OverlapConfig | None = None
) -> Counter[str]:
    """The device operations of one forward of ``batch``, after a first forward has grown the
    caches and tables a steady-state step finds already there."""
    runner.forward(batch, overlap)
    with DeviceOpCounter() as counter:
        runner.forward(batch, overlap)
    return counter.ops
