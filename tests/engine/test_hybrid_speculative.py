"""Speculative decoding on Qwen3.5 (hybrid: Gated DeltaNet linear attention): a verify forward
keeps the recurrent state after each row and the next forward rolls it back to the accepted
rows. One process: the rolled-back state continues exactly as plain decoding's, a verify
sequence cut in two included. Real gloo ranks: n-gram drafts and Qwen3.5's own MTP layer
(``mtp.*``, two steps from one layer, asked for in vLLM's spelling) give plain greedy
decoding's tokens at ep=2 in none, tbo, tbo+two-chunk, sbo and dbo (one engine each), and
n-gram and MTP drafts under PP 2 and DP attention, with drafts rejected and rollbacks counted by the
ranks."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.model.loader import build_model
from moe_overlap.runtime.model_runner import ModelRunner
from tests.engine.test_prefix_exact import one_thread
from tests.helpers import every_mode, force_overlap, max_abs_diff, qwen3_5_hf_config

# a small vocabulary: the random-weight model repeats itself, so some n-gram drafts are accepted
VOCAB = 16
CFG = ModelConfig.from_hf(
    qwen3_5_hf_config(
        vocab_size=VOCAB,
        num_hidden_layers=3,  # a linear layer on each of PP 2's stages
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        max_position_embeddings=256,
    ).to_dict()
)
MTP = dataclasses.replace(CFG, num_nextn_predict_layers=1)  # one mtp.* layer
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")


def _requests(lengths: list[int], new: int) -> tuple[list[list[int]], SamplingParams]:
    prompts = [
        [(11 * i * (j + 3) + 7 * j) % VOCAB for i in range(n)] for j, n in enumerate(lengths)
    ]
    return prompts, SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)


def _verify(prefix: int, tokens: list[int], rows: slice = slice(None)) -> ForwardBatch:
    """Rows ``rows`` of one sequence's verify forward (its last token and drafts at
    ``prefix``): every row's logits, marked decode."""
    span = range(len(tokens))[rows]
    ids = torch.tensor(tokens[rows])
    return ForwardBatch(ids, [0], [prefix + span.start], [len(span)], [True], [True])


def _decode(prefix: int, token: int) -> ForwardBatch:
    return ForwardBatch(torch.tensor([token]), [0], [prefix], [1], is_decode=[True])


def test_a_rejected_draft_rolls_the_recurrent_state_back():
    """Prefill, a verify of three drafts of which one is accepted (whole, and cut in two as
    DBO may cut it), then decode: the state continues as plain decoding's (same logits), the
    slot absorbed exactly the accepted rows, and the runner counted one rollback."""
    with one_thread():
        _roll_back()


def _roll_back() -> None:
    prompt, fed = list(range(1, 11)), [7, 3, 9, 4]  # the last token and three drafts
    model = build_model(CFG, seed=0)  # stateless: each runner keeps its own caches
    runners = [ModelRunner(model, LocalDispatcher(CFG.num_experts), 2, 64) for _ in range(3)]
    prefill = ForwardBatch(torch.tensor(prompt), [0], [0], [10])
    for runner in runners:
        runner.forward(prefill)
    plain, whole, cut = runners
    want = [plain.forward(_decode(10 + i, t)) for i, t in enumerate(fed[:2])]
    rows = whole.forward(_verify(10, fed))
    assert max_abs_diff(rows[:2], torch.cat(want)) <= 1e-5
    cut.forward(_verify(10, fed, slice(0, 1)))  # a one-row piece, then the rest
    cut.forward_plain(_verify(10, fed, slice(1, 4)))
    next_token = 5
    expected = plain.forward(_decode(12, next_token))
    for runner in (whole, cut):  # accepted: the last token and one draft, 12 tokens in all
        got = runner.forward(_decode(12, next_token))
        assert runner.rollbacks == 1
        assert max_abs_diff(got, expected) <= 1e-5
        assert {a[0] for a in runner.states.absorbed.values()} == {13}
        assert not any(runner.states.kept.values())
    assert plain.rollbacks == 0


def _identity(
    llm: LLM, prompts, params, modes: dict, accepts: bool = True
) -> dict[str, tuple[int, int]]:
    """Plain decoding's tokens, then speculation's in each of ``modes`` (an overlap config, or
    None: the engine's own): per mode the verifications and rollbacks it ran. ``accepts``:
    some draft was accepted (n-gram drafts on a model that repeats itself)."""
    speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
    want = [out.token_ids for out in llm.generate(prompts, params)]
    llm.scheduler.speculation, ran = speculation, {}
    stats = speculation.stats
    for mode, overlap in modes.items():
        if overlap is not None:
            force_overlap(llm, overlap)
        before = (stats.verifications, stats.rollbacks)
        got = [out.token_ids for out in llm.generate(prompts, params)]
        assert got == want, mode
        ran[mode] = (stats.verifications - before[0], stats.rollbacks - before[1])
    assert stats.accepted_tokens > 0 or not accepts, stats
    assert stats.accepted_tokens < stats.draft_tokens, stats  # drafts rejected
    return ran


def test_ngram_on_qwen3_5_gives_plain_greedy_tokens_in_every_mode_at_ep2():
    prompts, params = _requests([1, 37, 200, 5, 12, 20, 3, 30], 16)  # eight at once
    configs = every_mode()
    with LLM(config=CFG, ep=2, seed=0, speculative_algorithm="NGRAM") as llm:
        ran = _identity(llm, prompts, params, {mode: configs[mode] for mode in MODES})
    assert all(v > 0 and r > 0 for v, r in ran.values()), ran


def test_mtp_on_qwen3_5_gives_plain_greedy_tokens_in_every_mode_at_ep2():
    prompts, params = _requests([1, 37, 200, 5, 12, 20, 3, 30], 12)
    configs = every_mode()
    vllm = '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}'  # EAGLE, two steps
    with LLM(config=MTP, ep=2, seed=0, speculative_config=vllm) as llm:
        assert llm.spec.mtp_steps == 2
        modes = {mode: configs[mode] for mode in MODES}
        ran = _identity(llm, prompts, params, modes, accepts=False)
    assert all(v > 0 and r > 0 for v, r in ran.values()), ran


def test_ngram_and_mtp_on_qwen3_5_under_pp2_and_dp_attention():
    prompts, params = _requests([1, 37, 9, 20], 10)
    layouts = {"pp2": dict(pp=2), "dp-attention": dict(tp=2, dp=2, enable_dp_attention=True)}
    drafters = {"NGRAM": CFG, "EAGLE": MTP}
    for (name, layout), (algorithm, cfg) in itertools.product(layouts.items(), drafters.items()):
        with LLM(config=cfg, seed=0, speculative_algorithm=algorithm, **layout) as llm:
            ran = _identity(llm, prompts, params, {name: None}, accepts=algorithm == "NGRAM")
        assert all(v > 0 and r > 0 for v, r in ran.values()), (algorithm, ran)
