"""``--overlap auto``: the choice as a pure function of its inputs, and exactness on gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.overlap.predict import (
    EXPLORE_WEIGHT,
    Calibration,
    Choice,
    StepStats,
    candidates,
    choose,
    corrected,
    explorations,
    explore,
    raw_times,
)
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, reference

# 1 ns per FLOP, 1 ms per pass, 4 MoE layers, 1 KB per token per all-to-all
CAL = Calibration(
    kappa=1e-9,
    per_seq=0.0,
    per_pass=1e-3,
    latency=0.0,
    bytes_per_s=1e9,
    bytes_per_token=1e3,
    moe_layers=4,
    expert_share=0.5,
    shared_share=0.0,
)


def stats(flops=1e8, tokens=1000, ranks=2, tbo_ok=True, dbo_split=500, seqs=1):
    return StepStats([flops] * ranks, [tokens] * ranks, [seqs] * ranks, tbo_ok, dbo_split)


def link(bytes_per_s: float, **factors: float) -> Calibration:
    cal = dataclasses.replace(CAL, bytes_per_s=bytes_per_s, factor=dict.fromkeys(candidates(), 1.0))
    cal.factor.update(factors)
    return cal


# compute is 100 ms; communication is 8 all-to-alls of 1 MB: 8 ms at 1 GB/s, 80 ms at 100 MB/s
@pytest.mark.parametrize(
    ("cal", "step", "ep", "expected"),
    [
        (link(1e9), stats(), 1, "none"),  # one rank: nothing to hide
        (link(1e12), stats(), 2, "none"),  # a fast link: overlap only adds passes
        (link(1e8), stats(), 2, "tbo3"),  # comparable: three micro-batches fill best
        (link(1e8, tbo3=1.2), stats(), 2, "tbo2"),  # tbo3 measured slower than predicted
        (link(1e8, tbo2=1.3, tbo3=1.3), stats(), 2, "dbo"),
        (link(1e8), stats(tbo_ok=False), 2, "dbo"),  # ranks' modes disagree: no TBO
        (link(1e8), stats(tbo_ok=False, dbo_split=None), 2, "sbo"),  # only SBO is left
        (link(2e5), stats(tokens=2, dbo_split=1), 2, "tbo2"),  # too few tokens for three
        (link(1e8), stats(tokens=0, flops=0), 2, "none"),  # idle everywhere
        (link(3e8, sbo=1.03, tbo2=1.2, tbo3=1.25, dbo=1.25), stats(), 2, "none"),  # < MARGIN
    ],
)
def test_choice_table(cal, step, ep, expected):
    choice = choose(cal, step, ep)
    assert choice.mode == expected, choice.describe()
    assert choice.predicted[expected] == min(choice.predicted.values()) or expected == "none"


def test_predictions_follow_the_formulas():
    t = raw_times(link(1e8), stats())
    compute, comm, fill2 = 0.1, 0.08, (0.1 + 0.08) / (2 * 8)
    assert t["none"] == pytest.approx(compute + 1e-3 + comm)
    assert t["tbo2"] == pytest.approx(max(compute + 2e-3, comm) + fill2)
    assert t["sbo"] == pytest.approx(compute + 1e-3 + comm - min(comm / 4, 0.5 * compute / 2))
    assert t["none"] > t["sbo"] and t["none"] > t["tbo2"] > t["tbo3"]


def test_correction_moves_a_factor_towards_what_was_measured():
    cal = link(1e8)
    corrected(cal, "tbo2", 0.1, 0.2)
    assert cal.factor["tbo2"] == pytest.approx(0.7 + 0.3 * 2.0)
    corrected(cal, "tbo2", 0.1, 100.0)  # an outlier moves it by a bounded step
    assert cal.factor["tbo2"] <= 0.7 * 1.3 + 0.3 * 4.0 + 1e-9
    corrected(cal, "none", 0.0, 1.0)  # nothing to learn from a zero prediction
    assert cal.factor["none"] == 1.0


NEAR = Choice("none", {"none": 1.0, "sbo": 1.05, "tbo2": 1.1, "tbo3": 1.2, "dbo": 1.0})


@pytest.mark.parametrize(
    ("choice", "forward", "expected"),
    [
        (NEAR, 1, "none"),  # the calibrating forward never explores
        (NEAR, 2, "dbo"),  # first try: the nearest (dbo ties with none, within any margin)
        (NEAR, 3, "none"),  # not an exploring forward
        (NEAR, 4, "sbo"),  # second try: the next nearest
        (NEAR, 8, "tbo2"),  # third (tbo3 would be the fourth early try)
        (NEAR, 16, "dbo"),  # fourth: the turns wrap round (tbo3, 20% off, only early)
        (NEAR, 17, "none"),
        (NEAR, 32, "sbo"),
        (Choice("tbo2", {"none": 2.0, "tbo2": 1.0, "tbo3": 1.5}), 2, "tbo2"),  # none far off
        (Choice("dbo", {"dbo": 1.0, "tbo3": 1.2}), 2, "tbo3"),  # a first try looks 25% out
        (Choice("dbo", {"dbo": 1.0, "tbo3": 1.2}), 16, "dbo"),  # a later one 15%
        (Choice("tbo2", {"tbo2": 1.0}), 2, "tbo2"),  # nothing else fits this step
        (Choice("none", {}), 2, "none"),  # nothing allowed fits: stays none
        (
            Choice("sbo", {"none": 1.1, "sbo": 1.0, "tbo2": 1.14}),
            2,
            "none",
        ),  # nearest first, none included
    ],
)
def test_exploration_table(choice, forward, expected):
    ran = explore(choice, forward)
    assert ran.mode == expected
    assert ran.explored == (expected != choice.mode)
    assert ran.predicted == choice.predicted  # exploring changes what runs, not the prediction


def test_exploration_is_rare_and_its_measurement_counts_more():
    assert [f for f in range(1, 65) if explore(NEAR, f).explored] == [2, 4, 8, 16, 32, 48, 64]
    assert explorations(1) == 0 and explorations(8) == 3 and explorations(48) == 6
    assert "exploring" in explore(NEAR, 2).describe()
    cal = link(1e8, tbo2=2.0)  # measured slow once; an explored forward shows 1.0
    corrected(cal, "tbo2", 0.1, 0.1, weight=EXPLORE_WEIGHT)
    assert cal.factor["tbo2"] == pytest.approx(1.0)


def test_allowed_modes_restrict_the_choice():
    cal, step = link(1e12), stats()  # a fast link: none would win
    assert choose(cal, step, 2, ("none", "sbo")).mode == "none"
    forced = choose(cal, step, 2, ("tbo2", "dbo"))
    assert forced.mode == "tbo2" and set(forced.predicted) == {"tbo2", "dbo"}
    # nothing allowed fits this step (one token per rank): none
    assert choose(cal, stats(tokens=1, dbo_split=None), 2, ("tbo3",)) == Choice("none", {})
    with pytest.raises(ConfigError, match="--auto-modes='tbo9' must name some of"):
        OverlapConfig("auto", auto_modes=("tbo9",))


@pytest.fixture(scope="module")
def forced_overlap_engine():
    # one family: every mode auto runs is checked for both families in test_ep*.py; without
    # "none" among its modes auto overlaps every step, so its own paths are exercised
    cfg = ModelConfig(**TINY["qwen3_moe"])
    overlap = OverlapConfig("auto", auto_modes=("sbo", "tbo2", "tbo3", "dbo"))
    with LLM(config=cfg, ep=2, overlap=overlap, link="model:10mbit,50us", **KW) as llm:
        yield llm, reference(cfg), overlap


def test_auto_is_exact_at_ep2(forced_overlap_engine):
    llm, base, _ = forced_overlap_engine
    for case in ("mixed-batch", "single-long", "short+long"):
        assert_same(base[case], llm.generate(CASES[case], PARAMS, return_logits=True))


def test_auto_decides_alike_on_every_rank_and_records_why(forced_overlap_engine):
    llm, _, overlap = forced_overlap_engine
    batch = ForwardBatch(torch.arange(60) % 70, [0], [0], [60])
    for _ in range(3):
        reply = llm.executor.run([batch, batch], overlap, record=True)
        decisions = [[s.name for s in spans if s.track == "decision"] for spans in reply.spans]
        assert decisions[0] == decisions[1] and len(decisions[0]) == 1
        chosen, times = decisions[0][0].removeprefix("auto: ").split(" ", 1)
        assert chosen in overlap.auto_modes and f"{chosen} " in times
        predicted = [float(t.split()[-1]) for t in times.split(": ")[1].rstrip(")").split(", ")]
        assert len(predicted) >= 2 and min(predicted) >= 0 < max(predicted)  # factors stay > 0
