"""The all-to-all's input stays valid while the communication stream still reads it, on ONE GPU.

A 1-rank NCCL group is enough to reach the race: the communication stream is held busy (a
modelled link's delay), the dispatcher launches an all-to-all behind it, the caller drops its
rows, and new compute-stream allocations of the same size are overwritten before the transfer
runs. Without ``CommStream.hold`` (``record_stream`` on the communication stream) the caching
allocator hands the dropped rows' memory to those allocations and the transfer carries the
junk; with it, the received rows are the ones sent.

``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` keeps torch's NCCL backend from recording the input on its
own stream, so the dispatcher's own protection is what the test sees, whatever torch's default.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.distributed.groups import Group
from moe_overlap.distributed.streams import CommStream
from tests.gpu.common import needs_gpu

pytestmark = needs_gpu
ROWS, WIDTH, HOLD_S = 4096, 1024, 0.3


@pytest.fixture
def one_rank_nccl(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Group([0], 0, dist.group.WORLD, backend="nccl", name="ep")
    finally:
        dist.destroy_process_group()


def _send_then_reuse(group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch an all-to-all behind a busy communication stream, drop its rows, overwrite
    fresh compute-stream allocations; return (what was sent, what arrived)."""
    dispatcher = AllToAllDispatcher(group, num_experts=1)
    dispatcher.comm.cycles_per_s()  # measured before anything is timed
    rows = torch.randn(ROWS, WIDTH, device=group.device)
    sent = rows.clone()
    torch.cuda.synchronize()
    with dispatcher.comm.launch():
        dispatcher.comm.delay(HOLD_S)  # the stream is busy; the transfer queues behind this
    flight = dispatcher._start("dispatch", rows, [ROWS], [ROWS], "mb0")
    del rows  # the caller's reference goes, as dispatch_a's local does
    junk = [torch.empty(ROWS, WIDTH, device=sent.device).fill_(-7.0) for _ in range(4)]
    received = flight.wait().clone()
    torch.cuda.synchronize()
    del junk
    return sent, received


def test_dropped_rows_are_not_reused_while_the_transfer_reads_them(one_rank_nccl):
    sent, received = _send_then_reuse(one_rank_nccl)
    assert torch.equal(received, sent)


def test_without_hold_the_transfer_reads_reused_memory(one_rank_nccl, monkeypatch):
    """The control: the race is real on this GPU, so the test above can fail."""
    monkeypatch.setattr(CommStream, "hold", lambda self, tensor: None)
    sent, received = _send_then_reuse(one_rank_nccl)
    assert not torch.equal(received, sent)
    assert (received == -7.0).any()


def test_a_second_wait_is_free_and_releases_the_work(one_rank_nccl):
    """The first wait on an NCCL handle drops its work (and the tensors it keeps); a later
    waiter on another stream still sees the transfer done."""
    rows = torch.randn(ROWS, WIDTH, device=one_rank_nccl.device)
    handle = one_rank_nccl.all_to_all(rows, [ROWS], [ROWS], async_op=True)
    out = handle.wait()
    assert handle._work is None
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert handle.wait() is out
        seen = out.clone()
    torch.cuda.synchronize()
    assert torch.equal(seen, rows)
