"""SGLang's layouts on real gloo ranks: tensor parallelism, DP attention and EP inside TP, each
under every overlap mode, against one process without overlap.

The configs have an odd vocabulary (79: padded to a multiple of the TP size) and, for Qwen3 at
attention TP 4, fewer KV heads (2) than ranks (replicated). One engine per family and layout
serves every mode through the per-step override of ``Executor.run`` (the bench's path).
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.factory import resolve_backend
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-ep2": dict(tp=2, ep=2),  # all-to-all, each attention-TP rank dispatching half
    "tp4-ep2": dict(tp=4, ep=2),  # moe-TP 2: gather, expert slices, all-reduce
    "tp4-dp2-ep2": dict(tp=4, dp=2, enable_dp_attention=True, ep=2),
    "tp4-dp4-ep4": dict(tp=4, dp=4, enable_dp_attention=True, ep=4),  # DeepSeek's
}
# thresholds low enough that the tiny batches really are cut
MODES = {
    "none": OverlapConfig(),
    "tbo+two-chunk": OverlapConfig("tbo"),
    "sbo": OverlapConfig("sbo"),
    "dbo": OverlapConfig("dbo", dbo_decode_token_threshold=1, dbo_prefill_token_threshold=2),
}
PROMPTS = [p for prompts in CASES.values() for p in prompts]  # 45 tokens > budget: chunked
_REFERENCE: dict[str, list] = {}


def _config(family: str) -> ModelConfig:
    return ModelConfig(**{**TINY[family], "vocab_size": 79})


def _reference(family: str) -> list:
    if family not in _REFERENCE:
        with LLM(config=_config(family), **KW) as llm:
            _REFERENCE[family] = llm.generate(PROMPTS, PARAMS, return_logits=True)
    return _REFERENCE[family]


@pytest.fixture(
    scope="module",
    params=[(f, lay) for lay in LAYOUTS for f in sorted(TINY)],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def engine(request):
    family, layout = request.param
    with LLM(config=_config(family), **LAYOUTS[layout], **KW) as llm:
        yield llm, family


@pytest.mark.parametrize("mode", MODES)
def test_layout_matches_one_process(engine, mode, monkeypatch):
    llm, family = engine
    force_overlap(llm, MODES[mode], monkeypatch)
    assert_same(_reference(family), llm.generate(PROMPTS, PARAMS, return_logits=True))


@pytest.mark.parametrize("mode", ["tbo+two-chunk", "dbo"])
def test_layout_really_micro_batches(engine, mode):
    """Exactness is no fallback to one batch: every rank ran two micro-batches."""
    llm = engine[0]
    ex = llm.executor
    batches = [
        ForwardBatch(torch.tensor(ids), [0], [0], [len(ids)], [True])
        # DBO (vLLM) cuts every group at half the longest: the shortest must reach past it
        for ids in ([(3 * i) % 79 for i in range(13)], [5] * 12, list(range(11)), [7] * 10)[
            : ex.num_dp
        ]
    ]
    plain = ex.run(batches, OverlapConfig())
    got = ex.run(batches, MODES[mode], record=True)
    for a, b in zip(plain.logits, got.logits, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-4)
    for rank, spans in enumerate(got.spans):
        assert {"mb0", "mb1"} <= {s.track for s in spans}, f"rank {rank}"


def test_idle_dp_group_joins_every_collective():
    """Two of four attention-DP groups have no request at all; the busy ones still finish."""
    cfg = _config("deepseek_v3")
    with LLM(config=cfg, **LAYOUTS["tp4-dp4-ep4"], overlap="tbo", **KW) as llm:
        got = llm.generate(CASES["short+long"], PARAMS, return_logits=True)
    with LLM(config=cfg, **KW) as llm:
        assert_same(llm.generate(CASES["short+long"], PARAMS, return_logits=True), got)


REFUSALS = {
    "heads": (dict(tp=8), "num_attention_heads=4 is not divisible by the attention TP size 8"),
    "experts": (dict(ep=3), "--ep=3 must divide num_experts=4"),
    "dp-divides-tp": (
        dict(tp=4, dp=3, enable_dp_attention=True),
        "--dp=3 does not divide --tp=4",
    ),
    "ep-divides-tp": (dict(tp=4, ep=3), "--ep=3 does not divide --tp=4"),
    "ep-above-tp": (dict(tp=2, ep=4), "--ep=4 is larger than --tp=2"),
    "moe-tp-width": (
        dict(tp=4, ep=1, moe_intermediate_size=6),
        "moe_intermediate_size=6 is not divisible by the moe-TP size 4",
    ),
    "kv-heads": (
        dict(tp=4, num_attention_heads=12, num_key_value_heads=3),
        "num_key_value_heads=3 and the attention TP size 4",
    ),
    "torch-needs-whole-experts": (
        dict(tp=4, ep=2, overlap=OverlapConfig(moe_a2a_backend="torch")),
        "--moe-a2a-backend=torch needs --ep equal to --tp",
    ),
    "torch-on-one-rank-stages": (
        dict(pp=2, overlap=OverlapConfig(moe_a2a_backend="torch")),
        "--moe-a2a-backend=torch needs more than one rank per pipeline stage",
    ),
}


def test_one_rank_pipeline_stages_dispatch_locally():
    """--pp 2 --tp 1: each stage's MoE layers hold every expert, so no all-to-all runs (it
    once ran over a one-rank group, paying the link's latency for nothing)."""
    assert resolve_backend("auto", ParallelConfig(pp=2)) == "local"
    assert resolve_backend("auto", ParallelConfig(pp=2, tp=2, ep=2)) == "torch"


@pytest.mark.parametrize("case", REFUSALS)
def test_layouts_sglang_refuses_are_clear_errors(case):
    kw, message = REFUSALS[case]
    model_keys = {k: kw.pop(k) for k in list(kw) if k in TINY["qwen3_moe"]}
    cfg = ModelConfig(**{**TINY["qwen3_moe"], **model_keys})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(config=cfg, **kw)
