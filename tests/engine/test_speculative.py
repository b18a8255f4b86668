"""Speculative decoding with the n-gram drafter: greedy identity with plain decoding on real
ep=2 gloo ranks in every overlap mode (one engine serves them all), a verify batch split by
whole sequences, rejected drafts, and the requests speculation must leave as they were
(max_tokens, stop token ids, logprobs; sampled and penalised ones, verified too)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.core.batch import ForwardBatch, ForwardMode
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.timeline import split_rows
from moe_overlap.engine.ngram import propose
from moe_overlap.engine.spec_config import SpeculativeArgs
from moe_overlap.overlap.split import plan_even_tokens, plan_two_batch
from moe_overlap.runtime.verification import verify_greedy
from tests.helpers import TINY, every_mode, qwen3_5_hf_config
from tests.server.test_server import KEY, Running, _metrics, served_model

LONG = 600  # the long prompt
NEW = 36
CFG = ModelConfig(**(TINY["qwen3_moe"] | dict(max_position_embeddings=LONG + NEW + 8)))
MODES = ("none", "tbo", "tbo+two-chunk", "sbo", "dbo")
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
SERVED = dict(max_new_tokens=16)
STOP_AT = 9  # prompt 3 stops at the first occurrence of its plain output's token STOP_AT


def _prompts() -> list[list[int]]:
    lengths = [1, 37, LONG, 5, 12, 20, 3, 30]  # eight requests at once
    return [[(11 * i * (j + 3) + 7 * j) % 80 for i in range(n)] for j, n in enumerate(lengths)]


def _params(stop_id: int | None = None) -> list[SamplingParams]:
    """Plain greedy, greedy with logprobs, a max_tokens off the verify width, a stop token,
    a sampled and a penalised request (verified: rejection sampling by plain sampling's seeded
    draws, penalties per row); no stop token: requests 2 and 3 run to ``NEW`` instead."""
    p = [GREEDY] * 8
    p[1] = dataclasses.replace(GREEDY, logprobs=2)
    if stop_id is not None:
        p[2] = dataclasses.replace(GREEDY, max_new_tokens=NEW - 3)
        p[3] = dataclasses.replace(GREEDY, stop_token_ids=[stop_id])
    p[4] = SamplingParams(temperature=0.8, seed=5, max_new_tokens=NEW, ignore_eos=True, logprobs=1)
    p[5] = dataclasses.replace(GREEDY, repetition_penalty=1.3, logprobs=1)
    return p


def _recording(llm: LLM, overlap, seen: list) -> None:
    """Every step of ``llm`` runs ``overlap`` and records its spans into ``seen``."""
    step = type(llm.executor).step.__get__(llm.executor)

    def forced(request):
        reply = step(dataclasses.replace(request, overlap=overlap, record=True))
        seen.append((request.batches, reply.spans, request.samples, reply.groups))
        return reply

    llm.executor.step = forced


def _sequence_splits(seen: list) -> int:
    """Verify batches that TBO cut, each checked to be cut at whole sequences by SGLang's
    rule (DBO's cut is vLLM's token split point, shared by the ranks)."""
    cut = 0
    for batches, spans, _, _ in seen:
        for rank, batch in enumerate(batches):  # at ep=2 rank r runs group r's batch
            rows = split_rows(spans[rank] or [])
            if batch.mode != ForwardMode.TARGET_VERIFY or not rows:
                continue
            per_seq = batch.token_num_per_seq
            assert rows == [(batch.num_tokens // per_seq) // 2 * per_seq, *rows[1:]]
            assert sum(rows) == batch.num_tokens and all(r % per_seq == 0 for r in rows)
            cut += 1
    return cut


def _accepted(seen: list, sampled: bool) -> bool:
    """A sampled (or a penalised greedy) sequence had a draft accepted in some verify step."""
    return any(
        bool(more) and spec.verifies and (spec.temperature > 0 if sampled else spec.penalties)
        for _, _, samples, groups in seen
        for group, reply in zip(samples or [], groups, strict=True)
        for spec, more in zip(group, reply.more_ids, strict=True)
    )


def _expected(free, stop_id: int):
    """Plain decoding's outputs under ``_params(stop_id)``, from a run of the same requests
    without the max_tokens cut and the stop token: those two truncate it."""
    want = [(out.token_ids, out.finish_reason) for out in free]
    want[2] = (free[2].token_ids[: NEW - 3], "length")
    want[3] = (free[3].token_ids[: free[3].token_ids.index(stop_id) + 1], "stop")
    return want


def test_ngram_gives_plain_greedy_tokens_in_every_mode_at_ep2():
    """One ep=2 engine: plain decoding (speculation off) is the reference, then n-gram
    speculation in each mode gives its tokens, finish reasons and logprobs."""
    prompts, modes = _prompts(), every_mode()
    with LLM(config=CFG, ep=2, seed=0, speculative_algorithm="NGRAM") as llm:
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None
        free = llm.generate(prompts, _params())
        stop_id = free[3].token_ids[STOP_AT]
        want = _expected(free, stop_id)
        llm.scheduler.speculation, cuts = speculation, {}
        for mode in MODES:
            seen: list = []
            _recording(llm, modes[mode], seen)
            got = llm.generate(prompts, _params(stop_id))
            assert [(out.token_ids, out.finish_reason) for out in got] == want, mode
            for i in (1, 4, 5):  # greedy, sampled, penalised: the target's logprobs
                for a, b in zip(free[i].logprobs, got[i].logprobs, strict=True):
                    assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                    assert [t for t, _ in a.top] == [t for t, _ in b.top]
            cuts[mode] = _sequence_splits(seen) if mode.startswith("tbo") else 0
            assert any(b.mode == ForwardMode.TARGET_VERIFY for bs, *_ in seen for b in bs), mode
            assert _accepted(seen, sampled=True) and _accepted(seen, sampled=False), mode
    assert cuts["tbo"] > 0 and cuts["tbo+two-chunk"] > 0, cuts
    stats = speculation.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts accepted, and rejected
    assert stats.mean_acceptance_length > 1


def test_verify_batches_split_by_whole_sequences():
    k1 = 4  # three drafts and the last token
    batch = ForwardBatch(
        torch.arange(5 * k1), list(range(5)), [10, 3, 7, 1, 9], [k1] * 5, [True] * 5, [True] * 5
    )
    assert batch.mode == ForwardMode.TARGET_VERIFY and batch.decodes
    for plan in (plan_two_batch(batch, 0.48), plan_even_tokens(batch, 3)):
        assert all(p.start == 0 and p.length == k1 for child in plan for p in child)
    assert [len(c) for c in plan_two_batch(batch, 0.48)] == [2, 3]  # (20 // 4) // 2
    decode = ForwardBatch(torch.arange(3), [0, 1, 2], [4, 4, 4], [1] * 3, is_decode=[True] * 3)
    assert decode.mode == ForwardMode.DECODE and decode.token_num_per_seq == 1


def test_greedy_verification_and_the_ngram_drafter():
    rows = torch.eye(6)[[2, 3, 5, 1]]  # the target picks 2, 3, 5, 1
    assert verify_greedy(rows, (2, 3, 4)) == [2, 3, 5]  # two accepted, then the bonus
    assert verify_greedy(rows, (2, 3, 5)) == [2, 3, 5, 1]  # all accepted, and the bonus
    assert verify_greedy(rows, (0, 3, 5)) == [2]  # the first rejected: the target's token
    assert propose([1, 2, 3, 9, 1, 2, 3], 3, 1, 4) == [9, 1, 2]
    assert propose([1, 2, 3, 4], 3, 1, 4) == []  # the last token never occurred before
    assert propose([5, 6, 5, 7, 5], 2, 1, 4) == [7, 5]  # the latest occurrence
    assert propose([5, 6, 5, 7, 5], 2, 2, 4) == []  # below the minimum window


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
          "speculative_num_draft_tokens": 5}, "contradicts"),
        ({"speculative_config": '{"method": "eagle", "num_speculative_tokens": 2}'},
         "not one of ngram"),
        ({"speculative_config": "[1]"}, "JSON object"),
        ({"speculative_config": '{"method": "ngram", "draft_model": "x"}'}, "'draft_model'"),
        ({"speculative_num_draft_tokens": 3}, "needs --speculative-algorithm"),
        ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1}, ">= 2"),
        ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 3,
          "speculative_ngram_max_match_window_size": 2}, "min window size 3"),
    ],
)  # fmt: skip
def test_bad_speculative_settings_are_refused(settings, match):
    with pytest.raises(ConfigError, match=match):
        LLM(config=CFG, **settings)


def test_mtp_on_a_qwen3_5_without_mtp_layers_is_refused():
    with pytest.raises(ConfigError, match="is 0, or Qwen3.5's mtp_num_hidden_layers"):
        LLM(
            config=ModelConfig.from_hf(qwen3_5_hf_config().to_dict()), speculative_algorithm="EAGLE"
        )


def test_vllm_config_is_read_into_the_flags():
    with LLM(
        config=CFG,
        speculative_config='{"method": "ngram", "num_speculative_tokens": 2, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 3}',
    ) as llm:
        config = llm.scheduler.speculation.config
    assert (config.algorithm, config.num_drafts, config.lookup_min, config.lookup_max) == (
        "NGRAM", 2, 2, 3,
    )  # fmt: skip


def test_vllm_config_as_a_dict_as_vllms_llm_takes_it():
    """``LLM(speculative_config={...})`` is vLLM's Python form; it was a TypeError here."""
    given = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = SpeculativeArgs(speculative_config=given).speculative()
    assert config is not None and (config.algorithm, config.num_drafts) == ("NGRAM", 2)
    assert config.lookup_max == 3
    with pytest.raises(ConfigError, match="is not JSON"):
        SpeculativeArgs(speculative_config=3).speculative()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "method",
    ["mtp", "deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "mimo_v2_mtp"],
)
def test_vllm_mtp_methods_are_eagle_with_their_steps(method):
    given = json.dumps({"method": method, "num_speculative_tokens": 2})
    config = SpeculativeArgs(speculative_config=given).speculative()
    assert config is not None and (config.algorithm, config.num_drafts) == ("EAGLE", 2)


def test_served_speculation_streams_every_token_and_counts_acceptance(tmp_path_factory):
    """Over HTTP: a verify step's several tokens all reach the stream and the reply, the text
    is plain decoding's (and stops where a stop string in it begins), and /metrics counts
    drafts, accepted tokens and acceptance length."""
    path = served_model(tmp_path_factory, "speculative")
    prompt = "the cat sat on the mat; the cat sat on the mat; the cat"
    llm = LLM(path, speculative_algorithm="NGRAM")
    run = Running(llm, api_key=KEY)
    try:
        client = run.client()
        body = dict(model="tiny", prompt=prompt, max_tokens=SERVED["max_new_tokens"])
        extra = dict(temperature=0, extra_body={"ignore_eos": True})
        speculation, llm.scheduler.speculation = llm.scheduler.speculation, None  # idle: plain
        want = client.completions.create(**body, **extra).choices[0].text
        llm.scheduler.speculation = speculation
        whole = client.completions.create(**body, **extra).choices[0].text
        parts = [c.choices[0].text for c in client.completions.create(**body, **extra, stream=True)]
        stop = want[len(want) // 2 :][:2]  # a stop string inside plain decoding's text
        stopped = client.completions.create(**body, **extra, stop=[stop]).choices[0]
        got = _metrics(run)
    finally:
        run.stop()
    assert whole == want and "".join(parts) == want
    assert (stopped.text, stopped.finish_reason) == (want[: want.index(stop)], "stop")
    drafts, accepted = got["moe_overlap_spec_draft_tokens"], got["moe_overlap_spec_accepted_tokens"]
    verified = got["moe_overlap_spec_verifications"]
    assert 0 < accepted <= drafts and verified > 0
    assert got["moe_overlap_spec_mean_acceptance_length"] == (accepted + verified) / verified
