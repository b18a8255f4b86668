"""``--attention-backend flex_attention`` on a GPU: compiled FlexAttention reading the KV pages
in place gives the default backend's greedy tokens and log-probabilities (fp32), decoding
eagerly and from CUDA graphs, with a prefix-cache hit in the second wave; with the block list
the block table's width (the engine's) and as long as the pool (FlexAttention's own layout),
so that a failure says which."""

from __future__ import annotations

import pytest

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.model import flex_decode
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
CFG = ModelConfig.from_hf("configs/qwen3-moe-tiny.json")
PREFIX = [(7 * i + 3) % 500 for i in range(40)]
WAVES = [[PREFIX + [(9 * w + i) % 500] * (i + 1) for i in range(4)] for w in range(2)]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=0)


def both_waves(**kw) -> list:
    with LLM(config=CFG, device="cuda", dtype="float32", seed=0, max_model_len=128, **kw) as llm:
        return [out for wave in WAVES for out in llm.generate(wave, GREEDY)]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_flex_attention_reads_pages_as_the_gather_does(graphs, wide, monkeypatch):
    monkeypatch.setattr(flex_decode, "WIDE", wide)
    kw = dict(page_size=16, disable_cuda_graph=not graphs)
    base = both_waves(**kw)
    flex = both_waves(attention_backend="flex_attention", **kw)
    for a, b in zip(base, flex, strict=True):
        assert a.token_ids == b.token_ids
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)]
        assert max(diffs) <= 1e-3
