"""PD multiplexing's two lanes launch their collectives in one order on every rank (NCCL needs
it; gloo would not notice), recorded on real gloo ranks through ``serve_step``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moe_overlap import ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.step import StepRequest, WaveSlice
from moe_overlap.distributed.link import parse_link
from moe_overlap.distributed.order import CollectiveOrder, first_difference
from moe_overlap.runtime.rank import RankSpec, build_rank_runner, serve_step
from tests.dist_utils import init_gloo, run_workers
from tests.helpers import TINY

DECODE = ForwardBatch(torch.tensor([5, 6]), [0, 1], [3, 3], [1, 1], is_decode=[True, True])
PROMPT = ForwardBatch(torch.arange(8), [2], [0], [8])


def _delayed(fn, seconds: float):
    def run(*args, **kwargs):
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return run


def _lanes_worker(rank, world_size, port):
    """One decode step beside a prefill range, with the lanes' timing skewed the opposite way
    on each rank: rank 0's decode starts late, rank 1's prefill lane does. Returns the
    launches recorded with the turns on, then with them off (the code before the fix)."""
    init_gloo(rank, world_size, port)
    spec = EngineSpec(
        ModelConfig(**TINY["qwen3_moe"]),
        seed=0,
        max_num_seqs=4,
        max_len=64,
        parallel=ParallelConfig(ep=world_size),
        pdmux_splits=2,
    )
    runner = build_rank_runner(spec, RankSpec(rank, world_size, "", 30.0, parse_link("none")))
    lane, order = runner.prefill_lane, runner.prefill_lane.order
    if rank == 0:
        runner.forward = _delayed(runner.forward, 0.5)
    else:
        lane._run = _delayed(lane._run, 0.5)
    logs = []
    for turns in (True, False):
        order.log = []
        if not turns:
            order.begin = lambda lanes: None
        wave = WaveSlice([PROMPT], range(0, 1), 1 + turns, last=False)
        serve_step(runner, StepRequest([DECODE], prefill=wave), 0, answers=True)
        logs.append(order.log)
    return logs


def test_pdmux_lanes_launch_collectives_in_one_order_on_every_rank():
    (ordered0, free0), (ordered1, free1) = run_workers(_lanes_worker, 2, timeout=120)
    assert {lane for lane, _ in ordered0} == {"decode", "prefill"}
    assert first_difference([ordered0, ordered1]) is None
    # the recorder sees what the turns prevent: without them the skew reorders rank 1's launches
    assert first_difference([free0, free1]) is not None


def test_turns_alternate_and_a_finished_lane_stops_holding_the_other():
    order = CollectiveOrder(record=True)
    order.begin(["decode", "prefill"])

    def lane(name: str, count: int) -> None:
        for i in range(count):
            with order.launch(name, str(i)):
                pass
        order.end(name)

    prefill = threading.Thread(target=lane, args=("prefill", 4))
    prefill.start()  # it must wait for decode's first launch
    time.sleep(0.05)
    lane("decode", 2)
    prefill.join(timeout=5)
    assert not prefill.is_alive()
    names = [name for name, _ in order.log]
    assert names == ["decode", "prefill", "decode", "prefill", "prefill", "prefill"]


@pytest.mark.parametrize(
    ("logs", "message"),
    [
        ([[("a", "x"), ("b", "y")], [("b", "y"), ("a", "x")]], "launch 0: rank 0 ('a', 'x')"),
        ([[("a", "x")], [("a", "x"), ("b", "y")]], "rank 1 launched 2 collectives, rank 0 1"),
    ],
)
def test_first_difference_names_where_ranks_part(logs, message):
    assert message in first_difference(logs)
    assert first_difference([logs[0], list(logs[0])]) is None
