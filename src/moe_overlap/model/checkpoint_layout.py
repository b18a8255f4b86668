"""Which checkpoint tensor fills which part of which parameter: the one map the loader, the
seeded initialiser, the checkpoint writer and the FP8 weights kept resident all read."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.fused_experts import FusedExperts
from moe_overlap.model.moe import ExpertBank
from moe_overlap.model.mtp import mimo_name, qwen3_5_name
from moe_overlap.model.tensor_parallel import Segments, Shard

_EXPERT_PARAM = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")
_FUSED_PARAM = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")
Slice = Shard | Segments | FusedExperts | None  # which part of the checkpoint tensor a tensor holds


@dataclass
class Entry:
    """Checkpoint tensor ``name`` fills ``view`` (part of parameter ``param``), and ``shard``
    says which slice of the checkpoint tensor that is (None: all of it)."""

    name: str
    param: str
    view: torch.Tensor
    shard: Slice


def layout_entries(
    model: MoeForCausalLM, source: Mapping[str, torch.Tensor] | None = None
) -> list[Entry]:
    """Every checkpoint tensor this rank needs. ``source``: views into these tensors (by
    parameter name, of the parameters' leading shape) in place of the parameters, and only
    for the parameters it names."""
    entries: list[Entry] = []
    listed: set[int] = set()  # a module shared under two names (Qwen3.5's MTP head) reads once
    for param, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in listed:
            continue
        listed.add(id(tensor))
        shard = getattr(tensor, "shard", None)  # the parameter's, whatever fills it
        if source is not None:
            if param not in source:
                continue
            tensor = source[param]
        name = param
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            if model.has_embedding:
                continue  # the embedding's own tensor
            name = "model.embed_tokens.weight"  # a last stage without the embedding reads it
        if model.cfg.is_hybrid:  # Qwen3.5's MTP layers are mtp.*
            name = qwen3_5_name(name, model.cfg.num_hidden_layers)
        if model.cfg.is_mimo:  # its MTP layers are model.mtp.*; the Hub's name of its sinks
            name = mimo_name(name, model.cfg.num_hidden_layers)
            name = name.replace(".self_attn.sinks", ".self_attn.attention_sink_bias")
        if model.cfg.is_gpt_oss:  # its router is mlp.router, its experts fused tensors
            name = name.replace(".mlp.gate.", ".mlp.router.")
            fused = _FUSED_PARAM.fullmatch(name)
            if fused is not None:
                bank = model.get_submodule(fused[1])
                assert isinstance(bank, ExpertBank), f"{fused[1]} is not an expert bank"
                where = FusedExperts.of(name.rsplit(".", 1)[1], bank, model.cfg.num_experts)
                entries.append(Entry(name, param, tensor.detach(), where))
                continue
        match = _EXPERT_PARAM.fullmatch(name)
        if match is None:
            entries.append(Entry(name, param, tensor.detach(), shard))
            continue
        entries += _expert_entries(model, match[1], match[2], param, tensor.detach())
    return entries


def _expert_entries(
    model: MoeForCausalLM, prefix: str, kind: str, param: str, tensor: torch.Tensor
) -> list[Entry]:
    bank = model.get_submodule(param.rsplit(".", 1)[0])  # ``prefix``: its checkpoint name
    assert isinstance(bank, ExpertBank), f"{param} is not an expert bank's"
    rows = Shard(0, bank.inter_start, bank.inter_full)  # gate and up: intermediate rows
    entries = []
    for i in range(bank.count):
        expert = f"{prefix}.{bank.logical[i]}"
        weights = tensor[i]
        if kind == "down_proj":
            cols = Shard(1, bank.inter_start, bank.inter_full)
            entries.append(Entry(f"{expert}.down_proj.weight", param, weights, cols))
        else:  # the fused matrix: gate rows first, then up rows
            gate, up = weights.split(bank.intermediate)
            entries.append(Entry(f"{expert}.gate_proj.weight", param, gate, rows))
            entries.append(Entry(f"{expert}.up_proj.weight", param, up, rows))
    return entries


def checkpoint_layout(model: MoeForCausalLM) -> dict[str, tuple[torch.Tensor, Slice]]:
    """Map each checkpoint tensor name this rank needs to the tensor (or view) it fills, and
    which slice of the checkpoint tensor that is (None: all of it)."""
    return {e.name: (e.view, e.shard) for e in layout_entries(model)}


def full_shape(dest: torch.Tensor, shard: Slice) -> tuple[int, ...]:
    return tuple(dest.shape) if shard is None else shard.full_shape(dest.shape)


def fill(dest: torch.Tensor, shard: Slice, whole: torch.Tensor) -> None:
    dest.copy_(whole if shard is None else shard.take(whole, dest.shape))
