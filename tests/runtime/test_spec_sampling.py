"""Speculative verification of sampled and penalised sequences, tested on the verification
function with given target rows: rejection sampling's token at each position follows the
target's distribution (a chi-square bound over many seeded draws, for one-hot drafts and for
drafts with their own distribution), a seeded sequence gets plain sampling's tokens, and
penalties count the drafts accepted before each row."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import NOTHING_ALLOWED
from moe_overlap.core.step import Penalties, SampleSpec
from moe_overlap.runtime.draws import probabilities
from moe_overlap.runtime.mtp_picks import DraftProbs, pick
from moe_overlap.runtime.sampler import answer, sample
from moe_overlap.runtime.verification import verify, verify_greedy

# row j predicts position j; top_k=5 cuts one of the six tokens from each row
ROWS = torch.tensor(
    [
        [1.0, 0.2, 0.9, -0.5, 0.4, -2.0],
        [0.1, 1.3, 0.0, 0.8, -1.0, 0.6],
        [0.3, -0.3, 1.1, 0.2, 0.0, 0.5],
    ]
)
SPEC = SampleSpec(temperature=0.7, top_k=5)
DRAWS = 2000
CHI2_LIMIT = 20.0  # chi-square with at most 4 degrees of freedom: exceeded with p < 5e-4


def _chi2(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Pearson's statistic of ``counts`` against ``probs``; a count where the probability is 0
    makes it infinite."""
    p = probs.double().numpy()
    n = counts.sum()
    if counts[p == 0].any():
        return float("inf")
    live = p > 0
    expected = n * p[live]
    return float(((counts[live] - expected) ** 2 / expected).sum())


def _positions(draft_probs: torch.Tensor | None) -> tuple[list[np.ndarray], np.ndarray]:
    """Each position's token counts over ``DRAWS`` seeded verifications (a position counted
    when the sequence reaches it), and the first drafts' own counts."""
    rng = np.random.default_rng(0)
    counts = [np.zeros(ROWS.shape[1], dtype=np.int64) for _ in range(ROWS.shape[0])]
    first = np.zeros(ROWS.shape[1], dtype=np.int64)
    for seed in range(DRAWS):
        if draft_probs is None:
            drafts = (0, 1)  # fixed one-hot drafts, as n-gram's
        else:
            drafts = tuple(int(rng.choice(6, p=q.numpy())) for q in draft_probs)
        first[drafts[0]] += 1
        got = verify(ROWS, dataclasses.replace(SPEC, seed=seed, drafts=drafts), draft_probs)
        for j, token in enumerate(got):
            counts[j][token] += 1
    return counts, first


def test_rejection_sampling_keeps_the_target_distribution_at_every_position():
    q = torch.softmax(
        torch.tensor(
            [[0.0, 1.5, 0.0, 1.0, -1.0, 0.5], [2.0, 0.0, 0.0, 0.0, 0.5, 0.0]], dtype=torch.float64
        ),
        -1,
    )
    for draft_probs in (None, q):
        counts, first = _positions(draft_probs)
        for j, got in enumerate(counts):
            target = probabilities(ROWS[j], SPEC)
            assert got.sum() > DRAWS // 20, (j, got)  # drafts accepted: later rows reached
            assert _chi2(got, target) < CHI2_LIMIT, (draft_probs is None, j, got, target)
        if draft_probs is not None:  # the test has power: the drafts' own law is far from p
            assert _chi2(first, probabilities(ROWS[0], SPEC)) > 10 * CHI2_LIMIT


def test_one_hot_drafts_give_plain_sampling_tokens_whatever_the_drafts():
    for seed in range(40):
        plain = [
            sample(ROWS[j], dataclasses.replace(SPEC, seed=seed, index=7 + j)) for j in range(3)
        ]
        for drafts in ((plain[0], plain[1]), (plain[0], 5), (4, 4)):
            spec = dataclasses.replace(SPEC, seed=seed, index=7, drafts=drafts)
            got = verify(ROWS, spec)
            assert got == plain[: len(got)] and got == verify(ROWS, spec)  # reproducible
            accepted = next((j for j, d in enumerate(drafts) if d != plain[j]), len(drafts))
            assert len(got) == accepted + 1


def test_penalties_count_the_drafts_accepted_before_each_row():
    rows = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 2.0, 1.8, 0.0], [0.0, 0.0, 0.0, 3.0]])
    spec = SampleSpec(drafts=(1, 1), penalties=Penalties(repetition=1.5))
    assert verify_greedy(rows, (1, 1)) == [1, 1, 3]  # without the penalty both are accepted
    assert verify(rows, spec) == [1, 2]  # row 1 sees token 1 as generated: 2 / 1.5 < 1.8
    # min_tokens masks the stop token until the row whose index reaches it
    stop = SampleSpec(index=1, drafts=(1, 1), penalties=Penalties(min_tokens=3, stop_ids=(3,)))
    assert verify(rows, stop) == [1, 1, 3] and verify(rows, dataclasses.replace(stop, index=0)) == [
        1,
        1,
        0,
    ]


def test_a_verify_row_min_tokens_leaves_no_token_is_the_nothing_allowed_error():
    """A structured output whose grammar allows only its stop token (3), which min_tokens
    holds back: a verify step fails it as plain sampling does (``NOTHING_ALLOWED``, the
    client's 400), at the deciding row and at a row after accepted drafts; it was a grammar
    error (greedy: the argmax of an all -inf row) or torch's inf error (sampled)."""
    batch = ForwardBatch(torch.arange(3), [0], [5], [3], [True], [True])
    only, two = bytes([1 << 3, 0, 0, 0]), bytes([(1 << 3) | (1 << 0), 0, 0, 0])
    held = Penalties(min_tokens=9, stop_ids=(3,))
    for temperature in (0.0, 0.7):
        for allowed in ((only,), (two, only)):  # row 0 itself; row 1, after draft 0 is taken
            spec = SampleSpec(temperature, drafts=(0, 0), penalties=held, allowed=allowed)
            got = answer(batch, ROWS, [spec], "none")
            assert got.token_ids == [None] and got.errors == [NOTHING_ALLOWED], (allowed, got)


def test_the_sampling_rank_passes_draft_probabilities_to_verification():
    """``answer`` verifies a sequence's rows with the drafter's q where one is given."""
    batch = ForwardBatch(torch.arange(3), [0], [5], [3], [True], [True])
    q = torch.full((2, 6), 1 / 6, dtype=torch.float64)
    for seed in range(20):
        spec = dataclasses.replace(SPEC, seed=seed, drafts=(0, 1))
        got = answer(batch, ROWS, [spec], "none", [q])
        assert [got.token_ids[0], *got.more_ids[0]] == verify(ROWS, spec, q)
        plain = answer(batch, ROWS, [spec], "none")
        assert [plain.token_ids[0], *plain.more_ids[0]] == verify(ROWS, spec)


def test_mtp_drafts_drawn_from_their_q_keep_the_target_distribution():
    """The MTP drafter's sampled drafts (``mtp_picks.pick``: each drawn from the drafter's q by
    a seed stream of its own) verified against that q: every position follows the target's
    distribution; and the rank finds a sequence's q again only for the drafts it carries."""
    drafter = torch.tensor([[0.0, 1.5, 0.0, 1.0, -1.0, 0.5], [2.0, 0.0, 0.0, 0.0, 0.5, 0.0]])
    counts = [np.zeros(ROWS.shape[1], dtype=np.int64) for _ in range(ROWS.shape[0])]
    draws = DRAWS // 2  # the chi-square bound holds at any count; half keeps it quick
    for seed in range(draws):
        spec = dataclasses.replace(SPEC, seed=seed, index=4)
        drafts, probs = pick(drafter, [spec, spec], [4, 5])
        q = torch.stack([p for p in probs if p is not None])
        for j, token in enumerate(verify(ROWS, dataclasses.replace(spec, drafts=tuple(drafts)), q)):
            counts[j][token] += 1
    for j, got in enumerate(counts):
        assert got.sum() > draws // 20, (j, got)
        assert _chi2(got, probabilities(ROWS[j], SPEC)) < CHI2_LIMIT, (j, got)
    kept = DraftProbs()
    q = torch.softmax(drafter, -1)
    kept.keep(2, [4, 1], [q[0], q[1]])
    batch = ForwardBatch(torch.arange(6), [2, 5, 2], [5, 5, 5], [2, 2, 2], [True] * 3, [True] * 3)
    specs = [dataclasses.replace(SPEC, drafts=d) for d in ((4,), (4,), (1,))]
    found = kept.of(batch, specs)
    assert torch.equal(found[0], q[:1]) and found[1] is None and found[2] is None
