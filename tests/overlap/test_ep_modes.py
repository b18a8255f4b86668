"""The overlap modes tested on one process in test_overlap_one_process.py, now on real gloo
ranks (time-balanced cuts, three and four micro-batches), and the cross-rank TBO agreement.

Starting ranks costs 5-10 s on two busy cores, so one ep=2 engine per family serves every
mode: its own mode through ``LLM(overlap=...)``, the others through the per-step override of
``Executor.run`` (the bench's path; both reach ``ModelRunner.forward`` with the same config).
"""

from __future__ import annotations

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core import tracks
from moe_overlap.core.batch import ForwardBatch, ForwardMode
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.overlap_stats import overlap_stats
from moe_overlap.core.timeline import split_rows
from moe_overlap.overlap.agreement import tbo_decide, tbo_local_vote
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap, reference

MODES = {
    "tbo4+time-split": OverlapConfig("tbo", num_micro_batches=4, tbo_split_policy="time"),
    "tbo+time-split": OverlapConfig("tbo", tbo_split_policy="time"),
    "tbo3": OverlapConfig("tbo", num_micro_batches=3),
    "tbo3+time-split": OverlapConfig("tbo", num_micro_batches=3, tbo_split_policy="time"),
    "tbo4": OverlapConfig("tbo", num_micro_batches=4),
    "tbo+lockstep-decode": OverlapConfig("tbo", tbo_decode_order="lockstep"),
}
ENGINE_MODE = "tbo4+time-split"  # the mode the engines are built with


def _extend(ids: list[int], slot: int) -> ForwardBatch:
    return ForwardBatch(torch.tensor(ids), [slot], [0], [len(ids)], [True])


def _decode(ids: list[int], slots: list[int], prefixes: list[int]) -> ForwardBatch:
    n = len(ids)
    return ForwardBatch(torch.tensor(ids), slots, prefixes, [1] * n, is_decode=[True] * n)


def _same_logits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # allclose alone would broadcast; an idle rank's logits are empty on both sides
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-4)


def _tracks(spans) -> set[str]:
    return {s.track for s in spans}


@pytest.fixture(scope="module", params=sorted(TINY))
def engine(request):
    """(an ep=2 engine built in ENGINE_MODE, the one-process outputs without overlap)."""
    cfg = ModelConfig(**TINY[request.param])
    base = reference(cfg)
    with LLM(config=cfg, ep=2, overlap=MODES[ENGINE_MODE], **KW) as llm:
        yield llm, base


def _run_in(monkeypatch, llm: LLM, mode: str) -> None:
    """Make every step of ``llm`` run ``mode`` (unless the engine was built in it)."""
    if mode != ENGINE_MODE:
        force_overlap(llm, MODES[mode], monkeypatch)


@pytest.mark.parametrize("case", ["mixed-batch", "single-long"])  # cuts, chunks, MIXED steps
@pytest.mark.parametrize("mode", MODES)
def test_ep2_mode_matches_one_process(engine, mode, case, monkeypatch):
    llm, base = engine
    _run_in(monkeypatch, llm, mode)
    assert_same(base[case], llm.generate(CASES[case], PARAMS, return_logits=True))


@pytest.mark.parametrize("mode", MODES)
def test_ep2_mode_really_micro_batches(engine, mode):
    """The exactness above is no fallback to one batch: each rank runs every micro-batch."""
    llm, _ = engine
    overlap = None if mode == ENGINE_MODE else MODES[mode]
    batches = [_extend(list(range(1, 14)), slot=0), _extend([5] * 3 + [7] * 6, slot=0)]
    plain = llm.executor.run(batches, OverlapConfig())
    got = llm.executor.run(batches, overlap, record=True)
    for r in range(2):
        assert _same_logits(plain.logits[r], got.logits[r])
        n = MODES[mode].num_micro_batches
        names = {tracks.micro_batch(i) for i in range(n + 1)}
        assert names & _tracks(got.spans[r]) == {tracks.micro_batch(i) for i in range(n)}
        # every span lands on a track the readers know, so none drops out of the figures
        assert all(tracks.known(s.track) for s in got.spans[r]), _tracks(got.spans[r])
        stats = overlap_stats(got.spans[r])
        assert stats.comm_s > 0 and stats.compute_s > 0 and stats.hidden_s > 0


def test_ep4_tbo3_time_split_matches_one_process():
    cfg = ModelConfig(**TINY["deepseek_v3"])
    base = reference(cfg)
    with LLM(config=cfg, ep=4, overlap=MODES["tbo3+time-split"], **KW) as llm:
        for case in ("mixed-batch", "short+long"):
            assert_same(base[case], llm.generate(CASES[case], PARAMS, return_logits=True))


# --- all-to-alls with no rows ------------------------------------------------------------------

LONG13 = _extend(list(range(1, 14)), slot=0)
ZERO_ROWS = {  # (rank 0's batch, rank 1's, the modes where rank 0 runs a micro-batch of no rows)
    "idle+extend": (ForwardBatch.idle(), LONG13, ("tbo+time-split", "tbo3+time-split")),
    # three micro-batches of two tokens: the even cut leaves micro-batch 0 empty
    "two-tokens+extend": (_extend([3, 4], slot=1), LONG13, ("tbo3+time-split",)),
}


@pytest.mark.parametrize(
    ("scenario", "mode"), [(s, m) for s, (_, _, modes) in ZERO_ROWS.items() for m in modes]
)
def test_ep2_all_to_alls_with_no_rows_stay_exact(engine, mode, scenario):
    """A rank whose micro-batch holds no rows still joins every all-to-all (sending none,
    receiving its experts' rows), and both ranks' logits equal the unsplit forward's."""
    first, second, _ = ZERO_ROWS[scenario]
    executor = engine[0].executor
    plain = executor.run([first, second], OverlapConfig())
    got = executor.run([first, second], MODES[mode], record=True)
    rows = [split_rows(spans) for spans in got.spans]
    n = MODES[mode].num_micro_batches
    assert len(rows[0]) == len(rows[1]) == n and 0 not in rows[1]  # both ranks split
    assert 0 in rows[0] and sum(rows[0]) == first.num_tokens  # a micro-batch of no rows
    for r in range(2):
        assert _same_logits(plain.logits[r], got.logits[r]), f"rank {r}"


# --- cross-rank TBO agreement ---------------------------------------------------------------

CONTEXTS = [[(3 * i + 1) % 80 for i in range(9)], [(11 * i + 2) % 80 for i in range(14)]]
PREFILL = ForwardBatch(torch.tensor(CONTEXTS[0] + CONTEXTS[1]), [0, 1], [0, 0], [9, 14])
DECODE = _decode([21, 43], [0, 1], [9, 14])  # after PREFILL
EXTEND = ForwardBatch(torch.arange(20, 32), [2, 3], [0, 0], [5, 7], [True, True])
IDLE = ForwardBatch.idle()
ONE_TOKEN = _extend([17], slot=4)  # cannot be split: vetoes TBO on every rank
MIXED = ForwardBatch(torch.arange(6), [2, 0], [0, 9], [5, 1], is_decode=[False, True])

# (rank 0's batch, rank 1's batch, --tbo-mode-mismatch, the ranks that micro-batch)
AGREEMENT = {
    "extend+decode/off": (EXTEND, DECODE, "off", set()),  # SGLang: modes differ, no TBO
    "extend+decode/prefill": (EXTEND, DECODE, "prefill", {0, 1}),  # ours: prefill everywhere
    "decode+extend/off": (DECODE, EXTEND, "off", set()),
    "decode+decode/off": (DECODE, DECODE, "off", {0, 1}),
    "idle+extend/off": (IDLE, EXTEND, "off", {0, 1}),  # an idle rank has no mode to disagree
    "decode+idle/off": (DECODE, IDLE, "off", {0, 1}),
    "mixed+decode/off": (MIXED, DECODE, "off", set()),
    "extend+one-token/prefill": (EXTEND, ONE_TOKEN, "prefill", set()),
}


@pytest.mark.parametrize("scenario", AGREEMENT)
def test_tbo_agreement_on_gloo_ranks(engine, scenario):
    first, second, mismatch, micro_batching = AGREEMENT[scenario]
    executor = engine[0].executor
    executor.run([PREFILL, PREFILL], OverlapConfig())  # slots 0 and 1 hold DECODE's context
    # a decode step rewrites the K/V at its own position, so both runs see the same cache
    plain = executor.run([first, second], OverlapConfig())
    tbo = OverlapConfig("tbo", tbo_mode_mismatch=mismatch)
    got = executor.run([first, second], tbo, record=True)
    for r in range(2):
        assert _same_logits(plain.logits[r], got.logits[r])
        tracks = _tracks(got.spans[r])
        assert "mb0" in tracks  # the timeline recorded this rank
        assert ("mb1" in tracks) == (r in micro_batching), f"rank {r}"


def _vote(*batches: ForwardBatch) -> list[int]:
    """The MIN all-reduce of every rank's vote, as tbo_agree does it."""
    return [min(column) for column in zip(*(tbo_local_vote(b) for b in batches), strict=True)]


DECISIONS = {  # ranks' batches, --tbo-mode-mismatch -> run, decode strategy, reason
    "idle+extend": ((IDLE, EXTEND), "off", True, False, ""),
    "idle+decode": ((IDLE, DECODE), "off", True, True, ""),
    "idle+mixed": ((MIXED, IDLE), "off", True, False, ""),
    "extend+extend": ((EXTEND, EXTEND), "off", True, False, ""),
    "decode+decode": ((DECODE, DECODE), "off", True, True, ""),
    "decode+decode/prefill": ((DECODE, DECODE), "prefill", True, True, ""),
    "extend+decode": ((EXTEND, DECODE), "off", False, False, "modes (extend, decode)"),
    "extend+decode/prefill": ((EXTEND, DECODE), "prefill", True, False, ""),
    "idle+extend+decode": ((IDLE, EXTEND, DECODE), "off", False, False, "different forward"),
    "idle+extend+decode/prefill": ((IDLE, EXTEND, DECODE), "prefill", True, False, ""),
    "mixed+extend": ((MIXED, EXTEND), "off", False, False, "modes (extend, mixed)"),
    "mixed+decode": ((MIXED, DECODE), "off", False, False, "modes (decode, mixed)"),
    "mixed+decode/prefill": ((MIXED, DECODE), "prefill", True, False, ""),
    "all-idle": ((IDLE, IDLE), "off", False, False, "every rank is idle"),
    "all-idle/prefill": ((IDLE, IDLE), "prefill", False, False, "every rank is idle"),
    "one-token": ((EXTEND, ONE_TOKEN), "off", False, False, "cannot split"),
    "idle+one-token/prefill": ((IDLE, ONE_TOKEN), "prefill", False, False, "cannot split"),
    "one-decode-seq": ((DECODE, _decode([3], [0], [9])), "off", False, False, "cannot split"),
}


@pytest.mark.parametrize("combo", DECISIONS)
def test_tbo_decide_table(combo):
    batches, mismatch, run, decode, reason = DECISIONS[combo]
    decision = tbo_decide(_vote(*batches), mismatch)
    assert (decision.run, decision.decode) == (run, decode)
    assert reason in decision.reason
    assert bool(decision.reason) != run  # a reason exactly when TBO is off


def test_table_batches_have_the_modes_they_claim_and_sglang_is_the_default():
    modes = [b.mode for b in (IDLE, EXTEND, DECODE, MIXED)]
    assert modes == [ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED]
    assert OverlapConfig("tbo").tbo_mode_mismatch == "off"
    assert not tbo_decide(_vote(EXTEND, DECODE)).run


def test_ep2_lockstep_decode_micro_batches_and_stays_exact(engine):
    """A decode step in ``--tbo-decode-order lockstep`` (prefill's stages for decode) on gloo
    ranks: both micro-batches run, and the logits are the one-batch step's."""
    llm, _ = engine
    a, b = list(range(1, 9)), list(range(3, 12))
    prompts = ForwardBatch(torch.tensor(a + b), [0, 1], [0, 0], [8, 9], [True, True])
    llm.executor.run([prompts] * 2, OverlapConfig())
    step = [_decode([4, 6], slots=[0, 1], prefixes=[8, 9])] * 2
    plain = llm.executor.run(step, OverlapConfig())
    got = llm.executor.run(step, MODES["tbo+lockstep-decode"], record=True)
    for r in range(2):
        assert _same_logits(plain.logits[r], got.logits[r])
        assert {tracks.micro_batch(0), tracks.micro_batch(1)} <= _tracks(got.spans[r])
