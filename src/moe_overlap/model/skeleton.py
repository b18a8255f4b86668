"""A model whose parameters take no memory until the loader gives each its final form: built
with its parameters on ``meta`` (its buffers, RoPE's frequencies and the expert maps, are
real), then each parameter allocated once, in the run dtype (the routers and RoPE in float32),
so a load never holds a float32 copy of the whole model beside the one it keeps."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moe_overlap.core.model_config import ModelConfig
from moe_overlap.model.causal_lm import MoeForCausalLM
from moe_overlap.model.rope import RotaryEmbedding
from moe_overlap.model.router import Router
from moe_overlap.model.tensor_parallel import ModelParallel

KEPT_FP32 = (Router, RotaryEmbedding)  # the routing decision and RoPE stay in float32


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to ``meta`` as it is registered, with the
    attributes set on it (a ``Shard`` tag), so only one layer's tensor is ever allocated."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:  # a tied weight is already on meta
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def skeleton(cfg: ModelConfig, par: ModelParallel | None = None, mtp: bool = False):
    """``MoeForCausalLM(cfg, par, mtp)`` with every parameter on ``meta``."""
    with _parameters_on_meta():
        return MoeForCausalLM(cfg, par, mtp)


def materialize(model: nn.Module, dtype: torch.dtype) -> None:
    """Give each parameter still on ``meta`` an (unfilled) tensor on CPU: float32 in the
    routers and RoPE, ``dtype`` elsewhere. Tied parameters stay one tensor."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                kind = param.dtype if isinstance(module, KEPT_FP32) else dtype
                real = nn.Parameter(torch.empty(param.shape, dtype=kind), param.requires_grad)
                real.__dict__.update(param.__dict__)
                made[id(param)] = real
            module._parameters[name] = made[id(param)]
