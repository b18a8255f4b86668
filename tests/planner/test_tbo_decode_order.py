"""``--tbo-decode-order``: SGLang's staggered decode stages against ours in lockstep, on the
planner's clock (the engine's own schedules over FIFO compute and communication streams), and
a bad value refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.overlap_config import OverlapConfig
from tests.planner.test_plan import FLAT, batch, planner

LOCKSTEP = OverlapConfig(tbo_decode_order="lockstep")


def test_lockstep_decode_hides_the_transfers_the_staggered_stages_leave_exposed() -> None:
    """Qwen3-MoE decode (no shared experts) with T_comm two thirds of T_comp: the staggered
    stages record micro-batch 1's dispatch behind micro-batch 0's combine wait, so two
    transfers a layer wait in the open; in lockstep each flies under the other micro-batch's
    stage, as DBO's two streams do, in the order dispatch 0, dispatch 1, combine 0, combine 1."""
    p = planner(dataclasses.replace(FLAT, inter_node_a2a_gbps=0.001))
    batches = [batch([1] * 64, prefix=512, decode=True)] * 2
    none = p.plan("none", mode_config("none"), batches)
    staggered = p.plan("tbo", mode_config("tbo"), batches)
    lockstep = p.plan("tbo", mode_config("tbo", LOCKSTEP), batches, record=True)
    dbo = p.plan("dbo", mode_config("dbo"), batches)
    assert none.t_comm > 0.5 * none.t_comp
    assert lockstep.seconds < 0.85 * staggered.seconds < none.seconds
    assert lockstep.seconds == pytest.approx(dbo.seconds, rel=0.01)
    comm = [s.name for s in lockstep.spans[0] if s.track == "comm"]
    assert [n.rsplit(" ", 2)[0] for n in comm[:4]] == [  # less the bytes
        "layer 0 dispatch (mb0)",
        "layer 0 dispatch (mb1)",
        "layer 0 combine (mb0)",
        "layer 0 combine (mb1)",
    ]


def test_prefill_is_the_same_in_either_order() -> None:
    p = planner()
    batches = [batch([512, 512])] * 2
    staggered = p.plan("tbo", mode_config("tbo"), batches)
    lockstep = p.plan("tbo", mode_config("tbo", LOCKSTEP), batches)
    assert lockstep.seconds == staggered.seconds


def test_a_bad_order_is_refused_by_its_flag() -> None:
    with pytest.raises(ConfigError, match="--tbo-decode-order='sideways' must be one of"):
        OverlapConfig("tbo", tbo_decode_order="sideways")
