"""Risks a GPU cluster would show and one CPU cannot run: a CUDA handle waited twice, and a DBO
stall that leaves a thread inside a collective while its peers move on (over gloo here)."""

from __future__ import annotations

import os
import time
import weakref
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from moe_overlap.distributed.comm import CollectiveAborted, CommHandle
from moe_overlap.distributed.groups import Group
from moe_overlap.overlap.baton import DboStall, DualBatchThreads
from moe_overlap.overlap.operations import YIELD
from tests.dist_utils import init_gloo, run_workers


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class FakeEvent:
    def record(self, stream: FakeStream) -> None:
        self.stream = stream


class FakeWork:
    def __init__(self, waits: list[int]) -> None:
        self.waits = waits

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(1)
        return True

    def is_completed(self) -> bool:
        return False


def test_a_cuda_handle_releases_its_work_at_the_first_wait(monkeypatch):
    """NCCL's path without a GPU: the first wait makes its stream wait on the work and drops
    the work (and the tensors it keeps); a second wait on that stream does nothing, one on
    another stream waits on an event recorded after the first wait."""
    current = {"stream": FakeStream()}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    waits: list[int] = []
    work = FakeWork(waits)
    released = weakref.ref(work)
    out = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))

    def host_wait(*_):
        raise AssertionError("a CUDA wait without a timeout never blocks the host")

    handle = CommHandle(host_wait, work, out, "all_to_all")
    del work
    first = current["stream"]
    assert handle.wait() is out and waits == [1] and released() is None
    assert handle.wait() is out and waits == [1] and first.waited == []  # same stream: free
    current["stream"] = other = FakeStream()
    assert handle.wait() is out and waits == [1]
    assert len(other.waited) == 1 and other.waited[0].stream is first
    assert handle.is_completed()


def stall_worker(rank: int, ws: int, port: int, flag: str) -> dict:
    init_gloo(rank, ws, port, timeout_s=30.0)
    pg = dist.new_group([0, 1], timeout=timedelta(seconds=30))
    ep = Group([0, 1], rank, pg, timeout=timedelta(seconds=30), name="ep")
    if rank == 1:  # a peer that joins only once rank 0 is done, to let its thread go
        deadline = time.monotonic() + 25
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.all_reduce(torch.ones(2), group=pg)
        return {}
    threads = DualBatchThreads(timeout_s=1.0, on_stall=ep.abort)
    ops = [lambda ctx, **kw: ep.all_reduce(torch.ones(2)) and {}, YIELD, lambda ctx, **kw: {}]
    res: dict = {}
    try:
        start = time.monotonic()
        try:
            threads.run([SimpleNamespace(name="mb0"), SimpleNamespace(name="mb1")], ops, _hook)
        except DboStall as exc:
            res["stall"] = (time.monotonic() - start, str(exc))
        for name, call in [
            ("all_reduce", lambda: ep.all_reduce(torch.ones(2))),
            ("all_to_all", lambda: ep.all_to_all(torch.ones(2, 1), [1, 1], [1, 1])),
            ("send_dict", lambda: ep.send_dict({"x": torch.ones(1)}, 1)),
        ]:
            start = time.monotonic()
            try:
                call()
                res[name] = None
            except CollectiveAborted as exc:
                res[name] = (time.monotonic() - start, str(exc))
    finally:
        open(flag, "w").close()
    res["released"] = threads.last_run is not None and threads.last_run.gather(10.0)
    threads.close()
    return res


def _hook(ctx):
    return lambda waiter: None


def test_a_dbo_stall_aborts_the_group_so_nothing_pairs_with_the_thread_left_behind(tmp_path):
    """Micro-batch 0 sits in an all-reduce its peer never joins: the stall is raised within
    the baton's timeout, and every later collective on the group is refused at once instead of
    being issued beside the one still in flight (which a peer's next collective could match)."""
    res = run_workers(stall_worker, 2, str(tmp_path / "done"), timeout=40)[0]
    assert res["released"]  # the thread left behind returned once its peer joined
    elapsed, msg = res["stall"]
    assert elapsed < 5 and "micro-batch 0 stalled" in msg
    for name in ("all_reduce", "all_to_all", "send_dict"):
        assert res[name] is not None, name
        took, why = res[name]
        assert took < 0.5 and "group 'ep'" in why and "was aborted" in why and "stalled" in why


def test_a_group_of_one_rank_is_not_aborted():
    single = Group.single(name="ep")
    single.abort("a stall")
    assert torch.equal(single.all_reduce(torch.ones(2)), torch.ones(2))
