"""Pipeline parallelism on real gloo ranks: uneven stages, with TP and EP inside a stage, overlap
inside each stage, tied embeddings and SGLang's refusals (a stage that dies: test_ep.py)."""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import pp_layers
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap

PROMPTS = [p for prompts in CASES.values() for p in prompts]  # 45 tokens > budget: chunked
MODES = {"none": OverlapConfig(), "tbo+two-chunk": OverlapConfig("tbo")}


@pytest.mark.parametrize(
    ("layers", "stages", "sizes"),
    [(3, 2, [2, 1]), (4, 3, [1, 2, 1]), (61, 4, [15, 15, 16, 15]), (5, 5, [1] * 5)],
)
def test_stages_split_layers_like_sglang(layers, stages, sizes):
    ranges = [pp_layers(layers, s, stages) for s in range(stages)]
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order


def _reference(cfg: ModelConfig) -> list:
    with LLM(config=cfg, **KW) as llm:
        return llm.generate(PROMPTS, PARAMS, return_logits=True)


CASES_PP = {
    "deepseek-pp2-uneven": ("deepseek_v3", {}, dict(pp=2)),  # 3 layers: stages of 2 and 1
    "qwen3-pp3-uneven": ("qwen3_moe", {"num_hidden_layers": 4}, dict(pp=3)),  # 1, 2, 1
    "deepseek-tp2-pp2-ep2": ("deepseek_v3", {}, dict(tp=2, pp=2, ep=2)),
    "qwen3-tp2-pp2": ("qwen3_moe", {"vocab_size": 79}, dict(tp=2, pp=2)),
    "qwen3-pp2-tied": ("qwen3_moe", {"tie_word_embeddings": True}, dict(pp=2)),
}


@pytest.mark.parametrize("case", CASES_PP)
def test_pipeline_matches_one_process(case, monkeypatch):
    family, model_kw, layout = CASES_PP[case]
    cfg = ModelConfig(**{**TINY[family], **model_kw})
    base = _reference(cfg)
    with LLM(config=cfg, **layout, **KW) as llm:
        for overlap in MODES.values():
            force_overlap(llm, overlap, monkeypatch)
            assert_same(base, llm.generate(PROMPTS, PARAMS, return_logits=True))


def test_one_sequence_under_tp_leaves_a_micro_batch_empty():
    """One sequence decoding under pp=2 leaves a micro-batch with no rows; under TP its logits
    must keep the whole vocabulary's width (they were one rank's shard, and the merge failed)."""
    cfg = ModelConfig(**{**TINY["qwen3_moe"], "vocab_size": 79})
    with LLM(config=cfg, **KW) as llm:
        base = llm.generate(PROMPTS[:1], PARAMS, return_logits=True)
    with LLM(config=cfg, tp=2, pp=2, **KW) as llm:
        assert_same(base, llm.generate(PROMPTS[:1], PARAMS, return_logits=True))


def test_pipeline_refusals_name_the_flags():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    with pytest.raises(ConfigError, match="--pp=3 is more stages than the model's 2 layers"):
        LLM(config=cfg, pp=3)
    with pytest.raises(ConfigError, match=r"--pp=2 with pure expert parallelism \(--tp 1 --ep 2"):
        LLM(config=cfg, ep=2, pp=2)
    with pytest.raises(ConfigError, match="--overlap auto with --pp 2"):
        LLM(config=cfg, pp=2, overlap="auto")


def test_stages_work_on_different_micro_batches_at_once():
    """Stage 0 starts micro-batch 1 before stage 1 is done with micro-batch 0, so the stages
    compute at the same time (the ranks' timelines share one clock on this machine)."""
    cfg = ModelConfig(**TINY["deepseek_v3"])
    with LLM(config=cfg, pp=2, **KW) as llm:
        batch = ForwardBatch(torch.tensor([(3 * i) % 80 for i in range(40)]), [0], [0], [40])
        first, second = llm.executor.run([batch], record=True).spans
    span = {(rank, s.track): s for rank, spans in enumerate((first, second)) for s in spans}
    assert span[(0, "pp mb1")].start < span[(1, "pp mb0")].end
