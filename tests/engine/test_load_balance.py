"""Data-parallel replicas and SGLang's load-balancing policies: the policies as pure functions,
the scheduler's placement, and replicas on real gloo ranks against one process."""

from __future__ import annotations

import pytest

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.layout import layout_for
from moe_overlap.engine.load_balance import GroupLoad, choose_group
from moe_overlap.engine.request import Request, SamplingParams
from moe_overlap.engine.scheduler import Scheduler
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, reference

L = GroupLoad  # (requests, tokens, free slots)
# (method, loads, cursor, chosen group)
CHOICES = [
    ("round_robin", [L(5, 900, 1), L(0, 0, 4), L(1, 3, 2)], 0, 0),  # ignores load
    ("round_robin", [L(5, 900, 1), L(0, 0, 4), L(1, 3, 2)], 2, 2),
    ("round_robin", [L(5, 900, 1), L(0, 0, 4), L(1, 3, 0)], 2, 0),  # skips a full group
    ("shortest_queue", [L(3, 10, 1), L(1, 900, 1), L(2, 5, 1)], 0, 1),
    ("minimum_tokens", [L(3, 10, 1), L(1, 900, 1), L(2, 5, 1)], 0, 2),
    ("minimum_tokens", [L(0, 0, 0), L(4, 7, 1)], 0, 1),  # the idle one is full
    ("shortest_queue", [L(1, 1, 1), L(1, 2, 1)], 1, 0),  # ties: lowest index
    ("minimum_tokens", [L(0, 0, 0), L(0, 0, 0)], 0, None),  # nowhere: the request waits
    ("cache_aware", [L(3, 10, 1, 0), L(1, 9, 1, 32), L(0, 5, 1, 16)], 0, 1),  # most cached
    ("cache_aware", [L(3, 10, 1, 0), L(1, 9, 1, 0), L(0, 5, 1, 0)], 0, 2),  # none: shortest
    ("cache_aware", [L(40, 10, 1, 64), L(1, 9, 1, 0)], 0, 1),  # too unbalanced: shortest
]


@pytest.mark.parametrize(("method", "loads", "turn", "chosen"), CHOICES)
def test_policy_choices(method, loads, turn, chosen):
    assert choose_group(method, loads, turn) == chosen


def _request(i: int, prompt_len: int) -> Request:
    return Request(
        i, list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_new_tokens=2)
    )


@pytest.mark.parametrize(
    ("method", "placed"),
    [
        ("round_robin", [0, 1, 2, 0]),
        ("shortest_queue", [0, 1, 2, 0]),
        ("minimum_tokens", [0, 1, 2, 1]),  # group 1 holds the shortest prompt
    ],
)
def test_scheduler_places_by_policy(method, placed):
    sched = Scheduler(3, 4, 64, 64, load_balance_method=method)
    for i, n in enumerate([30, 2, 20, 5]):
        sched.add(_request(i, n))
    sched.schedule()
    assert [r.rank for r in sorted(sum(sched.running, []), key=lambda r: r.request_id)] == placed


def test_replica_layout_repeats_one_replica():
    layout = layout_for(ParallelConfig(tp=2, dp=2, ep=2))
    assert layout.world_size == 4 and layout.tp_groups == [[0, 1], [2, 3]]
    assert layout.ep_groups == [[0, 1], [2, 3]]  # no collective crosses replicas


def test_bad_method_is_named():
    with pytest.raises(ConfigError, match="--load-balance-method='fastest' must be one of"):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), dp=2, load_balance_method="fastest")


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue", "minimum_tokens"])
def test_replicas_match_one_process(method):
    cfg = ModelConfig(**TINY["deepseek_v3"])
    base = reference(cfg)
    with LLM(config=cfg, dp=2, load_balance_method=method, **KW) as llm:
        assert llm.executor.num_ranks == 2 and llm.executor.num_dp == 2
        for case in ("mixed-batch", "short+long"):
            assert_same(base[case], llm.generate(CASES[case], PARAMS, return_logits=True))


def test_tensor_parallel_replicas_match_one_process():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    base = reference(cfg)
    with LLM(config=cfg, tp=2, dp=2, ep=2, overlap="tbo", **KW) as llm:
        assert llm.executor.num_ranks == 4 and llm.executor.num_dp == 2
        assert_same(
            base["mixed-batch"], llm.generate(CASES["mixed-batch"], PARAMS, return_logits=True)
        )
