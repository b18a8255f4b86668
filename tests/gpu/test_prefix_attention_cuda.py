"""Attention after a prefix on a GPU (``model/layers.py: causal_attention``, torch's lower-right
``CausalBias``): in bf16 it is as close to an fp32 reference as SDPA with the boolean mask the
engine passed before, for GQA's shared KV heads and MLA's unequal head sizes; in fp32 (the GPU
checks' exactness runs) it gives that path's output within 1e-5. A full layer's sink attention
(``model/window_attention.py: sink_attention``, the sink one more SDPA key) is in bf16 as close
to the sink written out in fp32 as that written-out path is in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap.model import layers
from moe_overlap.model.layers import causal_attention
from moe_overlap.model.window_attention import extend_attention, sink_attention
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
# (sequences, new queries, prefix, query heads, KV heads, q/k head size, value head size)
SHAPES = {
    "gqa-chunk": (1, 300, 212, 8, 2, 128, 128),
    "gqa-verify": (6, 3, 40, 8, 2, 64, 64),
    "mla-chunk": (2, 96, 160, 4, 4, 192, 128),
}


def _masked(q, k, v, scale):
    new, length = q.shape[1], k.shape[1]
    mask = torch.ones(new, length, dtype=torch.bool, device=q.device).tril(length - new)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(qt, kt, vt, mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def _inputs(shape, dtype):
    n, new, prefix, heads, kv_heads, d, dv = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    length = new + prefix

    def randn(*size):
        return torch.randn(*size, generator=gen, device="cuda").to(dtype)

    q, k = randn(n, new, heads, d), randn(n, length, kv_heads, d)
    return q, k, randn(n, length, kv_heads, dv), prefix, d**-0.5


@pytest.mark.parametrize("shape", SHAPES)
@torch.inference_mode()
def test_bf16_is_as_close_to_fp32_as_the_boolean_mask(shape):
    q, k, v, prefix, scale = _inputs(SHAPES[shape], torch.float32)
    ref = _masked(q, k, v, scale)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    got = causal_attention(q, k, v, prefix, scale).float()
    assert not layers.BIAS_REFUSED, layers.BIAS_REFUSED  # the bias ran, not the fallback
    before = _masked(q, k, v, scale).float()
    assert (got - ref).abs().max() <= max(2 * (before - ref).abs().max().item(), 1e-2)


@pytest.mark.parametrize("shape", SHAPES)
@torch.inference_mode()
def test_fp32_gives_the_boolean_mask_output(shape):
    q, k, v, prefix, scale = _inputs(SHAPES[shape], torch.float32)
    got, before = causal_attention(q, k, v, prefix, scale), _masked(q, k, v, scale)
    torch.testing.assert_close(got, before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", ["gqa-chunk", "gqa-verify"])
@torch.inference_mode()
def test_bf16_sink_attention_is_as_close_to_fp32_as_the_written_out_sink(shape):
    q, k, v, prefix, scale = _inputs(SHAPES[shape], torch.float32)
    sinks = torch.linspace(-2.0, 3.0, q.shape[2], device="cuda")
    ref = extend_attention(q, k, v, prefix, 0, scale, 0, sinks)
    q, k, v, sinks = (t.bfloat16() for t in (q, k, v, sinks))
    got = sink_attention(q, k, v, prefix, scale, sinks, {}).float()
    assert not layers.BIAS_REFUSED, layers.BIAS_REFUSED
    before = extend_attention(q, k, v, prefix, 0, scale, 0, sinks).float()
    assert (got - ref).abs().max() <= max(2 * (before - ref).abs().max().item(), 1e-2)
