"""Prefix caching is exact under TP 2, DP attention and PP 2 for every attention family: for
Qwen3-MoE (GQA), DeepSeek-V3 (MLA), GPT-OSS (a sliding-window layer beside a full one) and
Qwen3.5 (hybrid linear attention, whose state is kept at the cached prefix's end), two waves of requests
sharing a 300-token prefix (the second finds it cached) give the greedy tokens and
log-probabilities (1e-4) of a one-process engine without the cache.

One test per layout runs the families' engines in turn (each starts its ranks in a fraction of
a second, forked from the zygote). Qwen3.5
is not run under TP 2: its linear-attention layers refuse attention TP
(``core/layout_rules.py``)."""

from __future__ import annotations

import pytest

from moe_overlap import LLM
from tests.engine.test_prefix_exact import (
    KW,
    assert_same,
    config,
    gpt_oss,
    one_thread,
    qwen3_5,
    two_waves,
)

PER_WAVE = 4
WAVE_HITS = PER_WAVE * 288  # wave 2: 18 full pages of 16 each, its last token computed


FAMILIES = {
    "qwen3_moe": lambda: config("qwen3_moe"),
    "deepseek_v3": lambda: config("deepseek_v3"),
    "gpt_oss": gpt_oss,
    "qwen3_5": qwen3_5,
}
LAYOUTS = {
    "tp2": dict(tp=2),
    "dp-attention": dict(tp=2, dp=2, enable_dp_attention=True),
    "pp2": dict(pp=2),
}
REFUSED_LAYOUTS = {"tp2": {"qwen3_5"}}  # linear attention does not run tensor parallel


@pytest.fixture(scope="module")
def references() -> dict[str, list]:
    """Each family's outputs from one process with the cache off."""
    refs = {}
    with one_thread():
        for family, make in FAMILIES.items():
            with LLM(config=make(), enable_prefix_caching=False, **KW) as llm:
                refs[family] = two_waves(llm, cached=False, per_wave=PER_WAVE)[0]
    return refs


def run_layout(layout: str, references: dict[str, list]) -> None:
    for family, make in FAMILIES.items():
        if family in REFUSED_LAYOUTS.get(layout, ()):
            continue
        with LLM(config=make(), **LAYOUTS[layout], **KW) as llm:
            outs, hits = two_waves(llm, per_wave=PER_WAVE)
        assert_same(references[family], outs)
        assert hits == WAVE_HITS, (layout, family)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_family_from_the_cache_matches_one_process_without_it(layout, references):
    run_layout(layout, references)
