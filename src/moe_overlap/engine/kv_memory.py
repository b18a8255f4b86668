"""The KV cache budget of each rank from the memory flags (``core/kv_budget.py`` says how)."""

from __future__ import annotations

import torch

from moe_overlap.core.device import ranks_on_this_node, torch_dtype
from moe_overlap.core.kv_budget import cpu_kv_bytes, gpu_kv_bytes
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import op_sizes
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.engine_args import EngineArgs


def kv_cache_bytes(args: EngineArgs, cfg: ModelConfig, par: ParallelConfig, device: str) -> int:
    """Bytes of KV cache per rank: ``--kv-cache-memory`` on CPU (or its default share of free
    memory); on a GPU ``--mem-fraction-static`` of its memory less the rank's weights."""
    if device != "cuda":
        if args.kv_cache_memory is not None:
            return args.kv_cache_memory
        return cpu_kv_bytes(ranks_on_this_node(par.world_size))
    total = torch.cuda.get_device_properties(0).total_memory
    return gpu_kv_bytes(total, args.mem_fraction_static, weight_bytes(cfg, par, args.dtype))


def weight_bytes(cfg: ModelConfig, par: ParallelConfig, dtype: str) -> int:
    """An estimate of one rank's weights before they load, from the cost model's per-op
    weights (``core/model_flops.py: op_sizes``): attention and dense MLPs over attention TP,
    the routed experts over ``--ep``, the embedding and the LM head."""
    ops, layers = op_sizes(cfg, par.attn_tp), cfg.num_hidden_layers
    attention = ops.full_share * (ops.attn_prepare + ops.attn_output + ops.attn_up)
    attention += (1 - ops.full_share) * (ops.linear_prepare + ops.linear_output)
    moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    experts = ops.expert * cfg.num_experts / par.ep + ops.gate + ops.shared
    total = layers * attention + moe * experts + (layers - moe) * ops.dense + 2 * ops.logits
    return int(total) * torch_dtype(dtype).itemsize
