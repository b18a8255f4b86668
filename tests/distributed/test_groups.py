"""Parallel layouts (pure arithmetic) and the Group wrapper on real gloo process groups."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.distributed.comm import CollectiveTimeout
from moe_overlap.distributed.groups import Group, init_process_groups
from moe_overlap.distributed.layout import GROUP_KINDS, ParallelLayout, layout_for
from tests.dist_utils import WorkerError, init_gloo, run_workers

# ---------------------------------------------------------------- layouts


def compute_layout(tp: int, pp: int, ep: int, dp: int, enable_dp_attention: bool) -> ParallelLayout:
    par = ParallelConfig(tp=tp, pp=pp, ep=ep, dp=dp, enable_dp_attention=enable_dp_attention)
    check_layout(par)
    return layout_for(par)


def test_tp2_pp4_contiguous_tp_strided_pp():
    lay = compute_layout(tp=2, pp=4, ep=1, dp=1, enable_dp_attention=False)
    assert lay.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.pp_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.ep_groups == [[r] for r in range(8)]
    assert lay.moe_tp_groups == lay.tp_groups
    assert lay.group_of("pp", 5) == [1, 3, 5, 7]
    c = lay.coords(5)
    assert (c.tp_rank, c.pp_rank, c.ep_rank, c.attn_tp_rank, c.attn_dp_rank) == (1, 2, 0, 1, 0)


def test_ep_equal_to_tp_is_the_tp_group():
    lay = compute_layout(tp=4, pp=2, ep=4, dp=1, enable_dp_attention=False)
    assert lay.ep_groups == lay.tp_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.moe_tp == 1 and lay.moe_tp_groups == [[r] for r in range(8)]


def test_ep_smaller_than_tp():
    lay = compute_layout(tp=4, pp=1, ep=2, dp=1, enable_dp_attention=False)
    assert lay.moe_tp == 2
    assert lay.ep_groups == [[0, 2], [1, 3]]
    assert lay.moe_tp_groups == [[0, 1], [2, 3]]
    assert [lay.coords(r).ep_rank for r in range(4)] == [0, 0, 1, 1]
    assert [lay.coords(r).moe_tp_rank for r in range(4)] == [0, 1, 0, 1]


def test_dp_attention_inside_tp():
    lay = compute_layout(tp=4, pp=1, ep=4, dp=2, enable_dp_attention=True)
    assert lay.attn_tp == 2
    assert lay.attn_tp_groups == [[0, 1], [2, 3]]
    assert lay.attn_dp_groups == [[0, 2], [1, 3]]
    assert [lay.coords(r).attn_dp_rank for r in range(4)] == [0, 0, 1, 1]
    assert [lay.coords(r).attn_tp_rank for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("dp", [1, "ep"])
def test_pure_expert_parallelism(ep, dp):
    lay = compute_layout(tp=1, pp=1, ep=ep, dp=ep if dp == "ep" else 1, enable_dp_attention=False)
    assert lay.pure_ep and lay.dp == ep and lay.attn_tp == 1
    assert lay.ep_groups == lay.attn_dp_groups == [list(range(ep))]
    assert lay.tp_groups == lay.attn_tp_groups == [[r] for r in range(ep)]
    for r in range(ep):
        c = lay.coords(r)
        assert (c.ep_rank, c.attn_dp_rank, c.tp_rank, c.attn_tp_rank) == (r, r, 0, 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (dict(tp=4, ep=3), r"--ep=3 does not divide --tp=4; choose ep in \{1, 2, 4\}"),
        (dict(tp=2, pp=2, ep=4), r"--ep=4 is larger than --tp=2"),
        (dict(tp=4, dp=3, enable_dp_attention=True), r"--dp=3 does not divide --tp=4; choose"),
        (dict(ep=2, pp=2), r"--pp=2 with pure expert parallelism .* --tp 2 --ep 2 --pp 2"),
        (dict(ep=4, dp=2, enable_dp_attention=True), r"--dp=2 with pure expert parallelism"),
        (dict(tp=0), r"--tp=0 must be an integer >= 1"),
        (dict(tp=4, ep=-1), r"--ep=-1 must be an integer >= 1"),
    ],
)
def test_impossible_layouts_raise_config_error(args, match):
    with pytest.raises(ConfigError, match=match):
        check_layout(ParallelConfig(**args))


@st.composite
def _valid_sizes(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pp = draw(st.integers(1, 3))
    divisors = [d for d in range(1, tp + 1) if tp % d == 0]
    ep, dp = draw(st.sampled_from(divisors)), draw(st.sampled_from(divisors))
    return tp, pp, ep, dp, dp > 1 or draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(_valid_sizes())
def test_every_kind_partitions_the_world_and_matches_sglang_formulas(sizes):
    tp, pp, ep, dp, dp_attn = sizes
    lay = compute_layout(tp, pp, ep, dp, dp_attn)
    for kind in GROUP_KINDS:
        flat = sorted(r for g in lay.groups(kind) for r in g)
        assert flat == list(range(tp * pp)), kind
    for r in range(tp * pp):
        c, tp_rank = lay.coords(r), r % tp
        assert (c.tp_rank, c.pp_rank) == (tp_rank, r // tp)
        assert (c.ep_rank, c.moe_tp_rank) == (tp_rank // (tp // ep), tp_rank % (tp // ep))
        assert (c.attn_dp_rank, c.attn_tp_rank) == (tp_rank // (tp // dp), tp_rank % (tp // dp))


# ---------------------------------------------------------------- one rank, no torch.distributed


def test_single_rank_group_needs_no_process_group():
    g = Group.single()
    t = torch.arange(6.0).reshape(3, 2)
    assert (g.rank, g.size, g.ranks) == (0, 1, [0])
    assert g.all_reduce(t) is t
    for out in (g.all_gather(t), g.reduce_scatter(t), g.all_to_all(t, [3], [3])):
        assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    handle = g.all_to_all(t, [3], [3], async_op=True)
    assert handle.is_completed() and torch.equal(handle.wait(timeout=0.1), t)
    g.barrier()
    with pytest.raises(ValueError, match="no peer"):
        g.send_dict({"x": t}, 0)
    with pytest.raises(ValueError, match="sum to 3 rows"):
        g.all_to_all(t, [2], [2])
    with pytest.raises(ValueError, match="no process group"):
        Group([0, 1], 0, None)


# ---------------------------------------------------------------- several ranks on gloo


def _a2a_scenarios(ws: int) -> dict[str, list[list[int]]]:
    """Rows that rank ``src`` sends to rank ``dst``: ``splits[src][dst]``."""
    rule = {
        "uneven": lambda s, d: (2 * s + 3 * d) % 4 + 1,
        "zero_splits": lambda s, d: (s + 2 * d) % 3,
        "rank1_receives_nothing": lambda s, d: 0 if d == 1 else s + d + 1,
        "all_to_rank0": lambda s, d: s + 2 if d == 0 else 0,
        "all_empty": lambda s, d: 0,
    }
    return {k: [[f(s, d) for d in range(ws)] for s in range(ws)] for k, f in rule.items()}


def _a2a_rows(src: int, dst: int, n: int) -> torch.Tensor:
    return torch.tensor([[src, dst, i] for i in range(n)], dtype=torch.float32).reshape(n, 3)


def _payload() -> dict[str, torch.Tensor]:
    return {
        "hidden": torch.linspace(-1, 1, 12).reshape(3, 4),
        "positions": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "transposed": torch.arange(6.0).reshape(2, 3).t(),
    }


def collectives_worker(rank: int, ws: int, port: int) -> dict:
    init_gloo(rank, ws, port)
    lay = layout_for(ParallelConfig(ep=ws))
    groups = init_process_groups(lay, rank, "gloo")
    g = groups["ep"]
    res: dict = {"ranks": {k: v.ranks for k, v in groups.items()}, "rank": g.rank}
    res["sum"] = g.all_reduce(torch.arange(4.0) + rank)
    res["max"] = g.all_reduce(torch.tensor([rank, -rank]), op=dist.ReduceOp.MAX)
    res["gather"] = g.all_gather(torch.full((2, 3), float(rank)))
    res["scatter"] = g.reduce_scatter(torch.arange(ws * 4).reshape(ws * 2, 2) * (rank + 1))
    for name, splits in _a2a_scenarios(ws).items():
        rows = torch.cat([_a2a_rows(rank, d, n) for d, n in enumerate(splits[rank])])
        res[name] = g.all_to_all(rows, splits[rank], [s[rank] for s in splits])
    splits = _a2a_scenarios(ws)["uneven"]
    rows = torch.cat([_a2a_rows(rank, d, n) for d, n in enumerate(splits[rank])])
    h = g.all_to_all(rows, splits[rank], [s[rank] for s in splits], async_op=True)
    h2 = g.all_reduce(torch.ones(2), async_op=True)
    res["async"] = (h.wait(timeout=20.0), h.is_completed(), h.wait() is h.wait(), h2.wait())
    res["self_send_rejected"] = _raises(ValueError, g.send_dict, {}, g.rank)
    if rank > 0:
        res["received"] = g.recv_dict(rank - 1)
    if rank < ws - 1:
        g.send_dict(res.get("received", _payload()), rank + 1)
    g.barrier()
    return res


def _raises(exc: type[Exception], fn, *args) -> bool:
    try:
        fn(*args)
    except exc:
        return True
    return False


@pytest.fixture(scope="module", params=[2, 3], ids=["ws2", "ws3"])
def gloo_run(request):
    ws = request.param
    return ws, run_workers(collectives_worker, ws, timeout=60)


def test_groups_from_layout(gloo_run):
    ws, results = gloo_run
    lay = layout_for(ParallelConfig(ep=ws))
    for rank, res in enumerate(results):
        assert res["rank"] == rank
        assert res["ranks"] == {k: lay.group_of(k, rank) for k in GROUP_KINDS} | {
            "world": list(range(ws))
        }


def test_all_reduce_all_gather_reduce_scatter(gloo_run):
    ws, results = gloo_run
    for rank, res in enumerate(results):
        assert torch.equal(res["sum"], torch.arange(4.0) * ws + sum(range(ws)))
        assert torch.equal(res["max"], torch.tensor([ws - 1, 0]))
        want = torch.cat([torch.full((2, 3), float(r)) for r in range(ws)])
        assert torch.equal(res["gather"], want)
        total = torch.arange(ws * 4).reshape(ws * 2, 2) * sum(range(1, ws + 1))
        assert res["scatter"].dtype == torch.int64
        assert torch.equal(res["scatter"], total[2 * rank : 2 * rank + 2])


@pytest.mark.parametrize("name", list(_a2a_scenarios(2)))
def test_all_to_all_splits(gloo_run, name):
    ws, results = gloo_run
    splits = _a2a_scenarios(ws)[name]
    for rank, res in enumerate(results):
        want = torch.cat([_a2a_rows(s, rank, splits[s][rank]) for s in range(ws)])
        assert res[name].shape == (sum(s[rank] for s in splits), 3)
        assert torch.equal(res[name], want)


def test_async_handles(gloo_run):
    ws, results = gloo_run
    splits = _a2a_scenarios(ws)["uneven"]
    for rank, res in enumerate(results):
        out, completed, same_twice, ones = res["async"]
        assert torch.equal(out, torch.cat([_a2a_rows(s, rank, splits[s][rank]) for s in range(ws)]))
        assert completed and same_twice
        assert torch.equal(ones, torch.full((2,), float(ws)))


def test_send_dict_recv_dict_chain(gloo_run):
    ws, results = gloo_run
    for rank, res in enumerate(results[1:], start=1):
        got, want = res["received"], _payload()
        assert list(got) == list(want), rank
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert all(res["self_send_rejected"] for res in results)


# ---------------------------------------------------------------- timeouts


def timeout_worker(rank: int, ws: int, port: int, flag: str) -> dict:
    init_gloo(rank, ws, port, timeout_s=1.5)  # the default every group inherits
    groups = init_process_groups(layout_for(ParallelConfig(ep=ws)), rank, "gloo")
    slow = Group([0, 1], rank, dist.new_group([0, 1], timeout=timedelta(seconds=30)), name="slow")
    if rank == 1:  # never joins; stays alive until rank 0 is done so no socket closes early
        deadline = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {}
    res: dict = {"default": groups["ep"].timeout.total_seconds()}
    try:
        h = slow.all_to_all(torch.ones(3, 2), [1, 2], [1, 0], async_op=True)
        res["pending"] = not h.is_completed()
        for key, call in [
            ("explicit", lambda: h.wait(timeout=1.0)),
            ("inherited", lambda: groups["ep"].all_reduce(torch.ones(2))),
        ]:
            t0 = time.monotonic()
            try:
                call()
                res[key] = None
            except CollectiveTimeout as e:
                res[key] = (time.monotonic() - t0, str(e))
    finally:
        open(flag, "w").close()
    return res


def test_wait_timeout_raises_collective_timeout(tmp_path):
    t0 = time.monotonic()
    res = run_workers(timeout_worker, 2, str(tmp_path / "done"), timeout=40)[0]
    assert res["default"] == 1.5 and res["pending"]
    assert res["explicit"] is not None and res["inherited"] is not None
    elapsed, msg = res["explicit"]
    assert 0.9 < elapsed < 4 and "all_to_all" in msg and "[0, 1]" in msg and "within 1 s" in msg
    elapsed, msg = res["inherited"]
    assert 1.4 < elapsed < 5 and "all_reduce" in msg and "'ep'" in msg and "within 1.5 s" in msg
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------- the test harness itself


def misbehaving_worker(rank: int, ws: int, port: int, how: str) -> int:
    if rank == 1 and how == "raise":
        raise KeyError("boom on rank 1")
    if rank == 1 and how == "hang":
        time.sleep(120)
    return rank


def test_run_workers_reports_a_worker_exception():
    with pytest.raises(WorkerError, match=r"(?s)rank 1 raised:.*KeyError: 'boom on rank 1'"):
        run_workers(misbehaving_worker, 2, "raise", timeout=20)


def test_run_workers_kills_a_hanging_worker():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 did not report"):
        run_workers(misbehaving_worker, 2, "hang", timeout=2)
    assert time.monotonic() - t0 < 10 and not mp.active_children()
