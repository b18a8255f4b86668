"""TBO on one process (local dispatcher): the split, the interleaving and the merge are exact.

The same checks at ep=2 and ep=4 over real all-to-alls live in test_ep.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.model import layers
from moe_overlap.model.loader import build_model
from moe_overlap.overlap.agreement import tbo_agree, tbo_local_vote
from moe_overlap.overlap.strategy import STRATEGIES, Strategy
from moe_overlap.overlap.tbo import TwoBatchOverlap
from moe_overlap.runtime.model_runner import ModelRunner
from tests.helpers import TINY

CASES = {
    "single-long": [[(7 * i) % 80 for i in range(45)]],
    "short+long": [[3, 4, 5], [(5 * i + 1) % 80 for i in range(40)]],
    "mixed-batch": [[9] * 12, [1, 2], list(range(30, 60)), [70, 71, 72]],
    "one-decode-token": [[11]],
}
MODES = [
    OverlapConfig("tbo"),
    OverlapConfig("tbo", tbo_token_distribution_threshold=0),
    OverlapConfig("tbo", num_micro_batches=3),
    OverlapConfig("tbo", tbo_split_policy="time"),
    OverlapConfig("tbo", num_micro_batches=4, tbo_split_policy="time"),
]


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("case", sorted(CASES))
def test_tbo_matches_no_overlap(family, case):
    cfg = ModelConfig(**TINY[family])
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    # a small token budget makes later steps MIXED (decodes beside prompt chunks)
    kw = dict(seed=0, max_num_batched_tokens=24)
    with LLM(config=cfg, **kw) as llm:
        base = llm.generate(CASES[case], params, return_logits=True)
    for overlap in MODES:
        with LLM(config=cfg, overlap=overlap, **kw) as llm:
            got = llm.generate(CASES[case], params, return_logits=True)
        for a, b in zip(base, got, strict=True):
            assert a.token_ids == b.token_ids
            assert (a.prompt_logits - b.prompt_logits).abs().max().item() <= 1e-4
            assert torch.isfinite(b.prompt_logits).all()


@pytest.mark.parametrize(("prefix", "new", "block"), [(5, 10, 3), (5, 10, 4), (1, 7, 2), (9, 6, 6)])
def test_query_blocks_attend_like_one_masked_call(prefix, new, block, monkeypatch):
    monkeypatch.setattr(layers, "QUERY_BLOCK", block)
    q, k, v = _attention_inputs(prefix, new)
    got = layers.causal_attention(q, k, v, prefix, scale=0.3)
    want = _written_out(q, k, v, prefix)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=0)


def test_the_gpu_paths_lower_right_bias_is_the_same_mask():
    """On a GPU a chunk after a prefix passes torch's ``CausalBias`` (a fused kernel's causal
    mode); here, where torch materialises it, it must mean the same keys per query."""
    prefix, new = 5, 10
    q, k, v = _attention_inputs(prefix, new)
    bias = layers._lower_right_bias(new, prefix + new)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    got = F.scaled_dot_product_attention(qt, kt, vt, bias, scale=0.3, enable_gqa=True)
    want = _written_out(q, k, v, prefix)
    assert torch.allclose(got.transpose(1, 2), want, atol=1e-5, rtol=0)


def _attention_inputs(prefix: int, new: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, new, 4, 8, generator=gen)
    k, v = (torch.randn(2, prefix + new, 2, 8, generator=gen) for _ in range(2))
    return q, k, v


def _written_out(q, k, v, prefix: int) -> torch.Tensor:
    """Every query row over its own keys 0 .. prefix + i, two query heads per KV head."""
    new = q.shape[1]
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k.repeat_interleave(2, dim=2)) * 0.3
    visible = torch.arange(prefix + new)[None, :] <= prefix + torch.arange(new)[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("nhqk,nkhd->nqhd", weights, v.repeat_interleave(2, dim=2))


@pytest.mark.parametrize("family", sorted(TINY))
def test_blocked_queries_are_exact(family, monkeypatch):
    monkeypatch.setattr(layers, "QUERY_BLOCK", 4)  # the tiny cases' pieces are a few tokens
    cfg = ModelConfig(**TINY[family])
    params = SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)
    prompts = CASES["single-long"] + CASES["mixed-batch"]
    kw = dict(seed=0, max_num_batched_tokens=40)
    with LLM(config=cfg, **kw) as llm:
        base = llm.generate(prompts, params, return_logits=True)
    for overlap in MODES[2:]:
        with LLM(config=cfg, overlap=overlap, **kw) as llm:
            got = llm.generate(prompts, params, return_logits=True)
        for a, b in zip(base, got, strict=True):
            assert a.token_ids == b.token_ids
            assert (a.prompt_logits - b.prompt_logits).abs().max().item() <= 1e-4


def test_overlap_flags_are_validated():
    with pytest.raises(ConfigError, match="--moe-a2a-backend='deepep' must be one of auto"):
        OverlapConfig("tbo", moe_a2a_backend="deepep")
    with pytest.raises(ConfigError, match="must be in \\[0, 0.5\\]"):
        OverlapConfig("tbo", tbo_token_distribution_threshold=0.6)
    with pytest.raises(ConfigError, match="overlap='fast' must be one of"):
        OverlapConfig("fast")


def test_a_custom_strategy_plugs_in_without_engine_changes():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    # a yield after every op of a MoE layer, three stages of lag
    names = [n for n in STRATEGIES["none", "qwen3", "prefill"].moe_ops if n != "shared_experts"]
    every_op = Strategy("every-op", tuple(x for n in names for x in (n, "|"))[:-1], 3)
    runner = ModelRunner(build_model(cfg, seed=1), LocalDispatcher(cfg.num_experts), 4, 64)
    scheme = TwoBatchOverlap(
        runner.model,
        OverlapConfig("tbo"),
        Group.single(),
        strategies={("tbo", "qwen3_moe", "prefill"): every_op},
    )
    batch = ForwardBatch(torch.arange(30) % 80, [0, 1], [0, 0], [12, 18], [True, True])
    expected = runner.forward_plain(batch)
    assert scheme.strategies[False] is every_op
    assert torch.allclose(scheme.forward(batch, runner).final_logits(), expected, atol=1e-5, rtol=0)


def test_tbo_min_tokens_threshold_edges():
    def batch(n, decode):
        return ForwardBatch(
            torch.zeros(n, dtype=torch.long),
            list(range(n if decode else 1)),
            [5] * (n if decode else 1),
            [1] * n if decode else [n],
            is_decode=[decode] * (n if decode else 1),
        )

    # [can split, not EXTEND, not DECODE, not MIXED]
    assert tbo_local_vote(batch(31, True), 32) == [0, 1, 0, 1]
    assert tbo_local_vote(batch(32, True), 32) == [1, 1, 0, 1]
    assert tbo_local_vote(batch(63, False), 64) == [0, 0, 1, 1]
    assert tbo_local_vote(batch(64, False), 64) == [1, 0, 1, 1]
    assert tbo_local_vote(ForwardBatch.idle(), 10**6) == [1, 1, 1, 1]  # idle never vetoes
    one_token = tbo_agree(batch(1, True), OverlapConfig("tbo"), Group.single())
    assert not one_token.run  # one decode token never splits
    with pytest.raises(ConfigError, match="--tbo-min-tokens=0 must be an integer >= 1"):
        OverlapConfig("tbo", tbo_min_tokens=0)
