"""Speculative decoding under the layouts beside pure EP: attention TP 2, DP attention (with
``--a2a-mode low_latency``, whose cap counts verify rows), PP 2 and PD multiplexing (verify
steps beside prefill waves) give plain decoding's tokens for eight concurrent requests (greedy
and seeded sampled), one engine per layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.a2a_mode import step_a2a_mode
from moe_overlap.core.batch import ForwardBatch, ForwardMode
from moe_overlap.core.errors import ConfigError
from tests.helpers import TINY

CFG = ModelConfig(**(TINY["qwen3_moe"] | dict(max_position_embeddings=160)))
CAP = 16  # low-latency tokens per rank: a verify step's rows stay within it
LAYOUTS = {
    "tp2-tbo": dict(tp=2, overlap="tbo"),
    "dp-attention-ep2-low-latency": dict(
        tp=2, dp=2, enable_dp_attention=True, ep=2, overlap="tbo", a2a_mode="low_latency",
        num_max_dispatch_tokens_per_rank=CAP, max_num_batched_tokens=CAP,
    ),
    "pp2": dict(pp=2),
    "pdmux": dict(enable_pdmux=True, pdmux_prefill_splits=2, max_num_batched_tokens=24),
}  # fmt: skip


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    lengths = [1, 37, 60, 5, 12, 20, 3, 30]
    prompts = [[(11 * i * (j + 3) + 7 * j) % 80 for i in range(n)] for j, n in enumerate(lengths)]
    greedy = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    params = [greedy] * len(prompts)
    params[3] = dataclasses.replace(greedy, temperature=0.8, seed=3)
    return prompts, params


def _verify_batches(llm: LLM, seen: list[ForwardBatch], waves: list[bool]) -> None:
    """Record every verify batch into ``seen``, and per verify step whether a prefill wave
    ran beside it into ``waves``."""
    step = type(llm.executor).step.__get__(llm.executor)

    def recording(request):
        verify = [b for b in request.batches if b.mode == ForwardMode.TARGET_VERIFY]
        seen.extend(verify)
        if verify:
            waves.append(request.prefill is not None)
        return step(request)

    llm.executor.step = recording


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_speculation_gives_plain_tokens_under_each_layout(layout):
    prompts, params = _requests()
    with LLM(config=CFG, seed=0, speculative_algorithm="NGRAM", **LAYOUTS[layout]) as llm:
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
        free = llm.generate(prompts, params)
        llm.scheduler.speculation, seen, waves = speculation, [], []
        _verify_batches(llm, seen, waves)
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in free]
    stats = speculation.stats
    assert seen and 0 < stats.accepted_tokens < stats.draft_tokens, stats
    if "a2a_mode" in LAYOUTS[layout]:  # every verify batch's rows within the low-latency cap
        assert max(b.num_tokens for b in seen) <= CAP and max(b.token_num_per_seq for b in seen) > 1
    assert any(waves) == ("enable_pdmux" in LAYOUTS[layout])


def test_low_latency_counts_verify_rows():
    k1 = 4  # three drafts and the last token, five sequences: 20 rows
    verify = ForwardBatch(
        torch.arange(5 * k1), list(range(5)), [9] * 5, [k1] * 5, [True] * 5, [True] * 5
    )
    assert verify.mode == ForwardMode.TARGET_VERIFY
    assert step_a2a_mode("auto", [verify], 20, True) == "low_latency"
    assert step_a2a_mode("auto", [verify], 16, True) == "normal"  # 20 rows over a cap of 16
    with pytest.raises(ConfigError, match="--num-max-dispatch-tokens-per-rank=16"):
        step_a2a_mode("low_latency", [verify], 16, True)
