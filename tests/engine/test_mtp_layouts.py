"""MTP speculation (``--speculative-algorithm EAGLE``) under the layouts beside pure EP: attention
TP 2, DP attention (ep=2) and PP 2, each under TBO, on real gloo ranks (fp32, tiny DeepSeek-V3
with one MTP layer, eight concurrent requests with prompts of 1, 37 and 200 tokens). Greedy
requests get plain decoding's tokens; under TP 2 and PP 2 (one data-parallel group, so the
same steps as one process) every step's drafts equal the one-process engine's, so the drafts
are the MTP layer's, run on the same rows by every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardMode
from tests.helpers import TINY

NEW = 16
CFG = ModelConfig(
    **(TINY["deepseek_v3"] | dict(num_nextn_predict_layers=1, max_position_embeddings=256))
)
MTP = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)
LAYOUTS = {
    "tp2": dict(tp=2),
    "dp-attention-ep2": dict(tp=2, dp=2, enable_dp_attention=True, ep=2),
    "pp2": dict(pp=2),
}
SAME_STEPS = ("tp2", "pp2")  # one data-parallel group: the one-process engine's steps
SAMPLED = (3, 6)  # seeded sampled requests: MTP drafts them from its own q
GREEDY = [i for i in range(8) if i not in SAMPLED]


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    lengths = [1, 37, 200, 5, 12, 20, 3, 30]
    prompts = [[(11 * i * (j + 3) + 7 * j) % 80 for i in range(n)] for j, n in enumerate(lengths)]
    greedy = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    params = [greedy] * len(prompts)
    for i in SAMPLED:
        params[i] = dataclasses.replace(greedy, temperature=1.0, seed=i)
    return prompts, params


def _run(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]], int]:
    """The requests' tokens, every step's drafts (per group, per sequence) and the number of
    verify batches."""
    step = type(llm.executor).step.__get__(llm.executor)
    drafts, verified = [], []

    def recording(request):
        reply = step(request)
        drafts.append([group.drafts for group in reply.groups])
        verified.extend(b for b in request.batches if b.mode == ForwardMode.TARGET_VERIFY)
        return reply

    llm.executor.step = recording
    prompts, params = _requests()
    tokens = [out.token_ids for out in llm.generate(prompts, params)]
    llm.executor.step = step
    return tokens, drafts, len(verified)


@pytest.fixture(scope="module")
def one_process():
    """Plain decoding's tokens, and the one-process MTP run's tokens and drafts (each engine
    fresh: a second run would start on prefix-cached pages, with other steps). One thread, as
    each spawned rank has: two on two shared cores make the tiny matmuls crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(config=CFG, seed=0) as llm:
            plain, _, _ = _run(llm)
        with LLM(config=CFG, seed=0, **MTP) as llm:
            tokens, drafts, _ = _run(llm)
            again, _, _ = _run(llm)
            stats = llm.scheduler.speculation.stats
            before = dataclasses.replace(stats)
            prompts, params = _requests()
            llm.generate([prompts[i] for i in SAMPLED], [params[i] for i in SAMPLED])
    finally:
        torch.set_num_threads(threads)
    assert [tokens[i] for i in GREEDY] == [plain[i] for i in GREEDY]
    # verified against q (one-hot drafts would give plain sampling's very tokens), seeded
    assert any(tokens[i] != plain[i] for i in SAMPLED) and again == tokens
    accepted, drafted = (
        stats.accepted_tokens - before.accepted_tokens,
        stats.draft_tokens - before.draft_tokens,
    )
    print(f"sampled requests alone: {accepted} of {drafted} MTP drafts accepted")
    assert 0 < accepted < drafted
    return plain, tokens, drafts


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mtp_gives_plain_greedy_tokens_under_each_layout(layout, one_process):
    plain, want, want_drafts = one_process
    with LLM(config=CFG, seed=0, overlap="tbo", **MTP, **LAYOUTS[layout]) as llm:
        tokens, drafts, verified = _run(llm)
        stats = llm.scheduler.speculation.stats
    assert [tokens[i] for i in GREEDY] == [plain[i] for i in GREEDY]
    assert all(len(t) == NEW for t in tokens)
    assert verified and 0 <= stats.accepted_tokens < stats.draft_tokens, stats
    assert any(d for groups in drafts for group in groups for d in group)  # MTP drafted
    if layout in SAME_STEPS:  # the same drafts, so the sampled requests' very tokens too
        assert drafts == want_drafts and tokens == want
