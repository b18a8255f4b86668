"""MTP speculation (``--speculative-algorithm EAGLE``) under the layouts beside pure EP: attention
TP 2, DP attention (ep=2) and PP 2, each under TBO, and PD multiplexing, on real gloo ranks
(fp32, tiny DeepSeek-V3 with one MTP layer, eight concurrent requests with prompts of 1, 37 and
200 tokens, two of them seeded sampled). Greedy requests get plain decoding's tokens, and their
drafts at each point equal the one-process engine's, so the drafts are the MTP layer's, run on
the same rows (a PD-mux wave's prompt included); under TP 2 and PP 2 (one data-parallel group,
the one-process engine's steps) every step's drafts and the sampled requests' tokens are the
one-process engine's too."""

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
    "tp2": dict(tp=2, overlap="tbo"),
    "dp-attention-ep2": dict(tp=2, dp=2, enable_dp_attention=True, ep=2, overlap="tbo"),
    "pp2": dict(pp=2, overlap="tbo"),
    "pdmux-ep2": dict(enable_pdmux=True, pdmux_prefill_splits=2, ep=2),
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


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    steps: list[list[list[int]]]  # every step's drafts, per group, per sequence
    after: dict[tuple[int, int], list[int]]  # (request, tokens it has) -> its drafts then
    verified: int  # verify batches


def _run(llm: LLM) -> Run:
    """The requests' tokens and drafts, by step and by where in the request they follow."""
    step, finish = type(llm.executor).step.__get__(llm.executor), llm.scheduler.finish
    prompts, params = _requests()
    which = {tuple(p): i for i, p in enumerate(prompts)}
    run = Run([], [], {}, 0)

    def recording(request):
        reply = step(request)
        run.steps.append([group.drafts for group in reply.groups])
        run.verified += sum(b.mode == ForwardMode.TARGET_VERIFY for b in request.batches)
        return reply

    class Taking:  # the scheduler's FinishRule (frozen), noting each request's drafts
        def __getattr__(self, name):
            return getattr(finish, name)

        def take(self, req, *args):
            finish.take(req, *args)
            run.after[which[tuple(req.prompt_ids)], len(req.output_ids)] = req.mtp_drafts

    llm.executor.step, llm.scheduler.finish = recording, Taking()
    run.tokens = [out.token_ids for out in llm.generate(prompts, params)]
    llm.executor.step, llm.scheduler.finish = step, finish
    return run


@pytest.fixture(scope="module")
def one_process():
    """Plain decoding's tokens, and the one-process MTP run's tokens and drafts (each engine
    fresh: a second run would start on prefix-cached pages, with other steps). One thread, as
    each spawned rank has: two on two shared cores make the tiny matmuls crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(config=CFG, seed=0) as llm:
            plain = _run(llm).tokens
        with LLM(config=CFG, seed=0, **MTP) as llm:
            mtp = _run(llm)
            stats = llm.scheduler.speculation.stats
            before = dataclasses.replace(stats)
            prompts, params = _requests()
            llm.generate([prompts[i] for i in SAMPLED], [params[i] for i in SAMPLED])
    finally:
        torch.set_num_threads(threads)
    tokens = mtp.tokens
    assert [tokens[i] for i in GREEDY] == [plain[i] for i in GREEDY]
    # verified against q (one-hot drafts would give plain sampling's very tokens); seeded, so
    # TP 2 and PP 2, which run the same steps, give the same tokens (below)
    assert any(tokens[i] != plain[i] for i in SAMPLED)
    accepted, drafted = (
        stats.accepted_tokens - before.accepted_tokens,
        stats.draft_tokens - before.draft_tokens,
    )
    print(f"sampled requests alone: {accepted} of {drafted} MTP drafts accepted")
    assert 0 < accepted < drafted
    return plain, mtp


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mtp_gives_plain_greedy_tokens_under_each_layout(layout, one_process):
    plain, want = one_process
    with LLM(config=CFG, seed=0, **MTP, **LAYOUTS[layout]) as llm:
        run = _run(llm)
        stats = llm.scheduler.speculation.stats
    assert [run.tokens[i] for i in GREEDY] == [plain[i] for i in GREEDY]
    assert all(len(t) == NEW for t in run.tokens)
    assert run.verified and 0 <= stats.accepted_tokens < stats.draft_tokens, stats
    # the greedy requests' drafts at each point equal one process's: the MTP layer ran on the
    # same rows (a PD-mux wave's prompt included: every request's first drafts)
    greedy = {key: d for key, d in want.after.items() if key[0] in GREEDY}
    assert {key: run.after.get(key) for key in greedy} == greedy
    assert all(greedy[i, 1] for i in GREEDY)
    if layout in SAME_STEPS:  # the same steps and drafts, so the sampled requests' tokens too
        assert run.steps == want.steps and run.tokens == want.tokens
