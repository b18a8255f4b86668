"""The torch all-to-all dispatcher on real gloo ranks, against the one-process computation."""

from __future__ import annotations

import pytest
import torch

from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.distributed.groups import init_process_groups
from moe_overlap.distributed.layout import layout_for
from tests.dist_utils import init_gloo, run_workers

EXPERTS, HIDDEN, TOP_K = 12, 6, 2


def routing(case: str, rank: int, world: int):
    """(hidden, topk_ids, topk_weights) of one rank for a named routing case."""
    gen = torch.Generator().manual_seed(rank)
    tokens = {"idle-rank": 0 if rank == world - 1 else 7}.get(case, 5 + 3 * rank)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    weights = torch.rand(tokens, TOP_K, generator=gen)
    if case == "all-to-rank-0":  # every token picks two experts that rank 0 owns
        ids = torch.stack([torch.zeros(tokens), torch.ones(tokens)], 1).long()
    else:
        picks = [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]
        ids = torch.stack(picks) if picks else torch.zeros(0, TOP_K, dtype=torch.long)
    return hidden, ids, weights


def expected(hidden, ids, weights):
    # a fake expert e multiplies its input by (e + 1)
    return (hidden[:, None, :] * (ids[..., None] + 1) * weights[..., None]).sum(1)


def worker(rank, world, port, case, p2p):
    init_gloo(rank, world, port)
    group = init_process_groups(layout_for(ParallelConfig(ep=world)), rank, "gloo")["ep"]
    dispatcher = AllToAllDispatcher(group, EXPERTS)
    group.all_to_all = _forced(group.all_to_all, p2p)
    hidden, ids, weights = routing(case, rank, world)
    state = dispatcher.dispatch_a(hidden, ids, weights)
    dispatcher.dispatch_b(state)
    local = EXPERTS // world
    scale = torch.repeat_interleave(
        torch.arange(local) + rank * local + 1.0, torch.tensor(state.tokens_per_expert)
    )
    state.expert_outputs = state.expert_inputs * scale[:, None]
    dispatcher.combine_a(state)
    out = dispatcher.combine_b(state)
    return (out - expected(hidden, ids, weights)).abs().max().item() if len(out) else 0.0, (
        sum(state.tokens_per_expert),
        tuple(out.shape),
    )


def _forced(all_to_all, p2p):
    return lambda *a, **kw: all_to_all(*a, **{**kw, "p2p": p2p})


@pytest.mark.parametrize("case", ["uneven", "all-to-rank-0", "idle-rank"])
@pytest.mark.parametrize("p2p", [True, False], ids=["p2p", "collective"])
def test_dispatch_combine_round_trip(case, p2p):
    world = 3 if case == "uneven" else 2
    results = run_workers(worker, world, case, p2p, timeout=60)
    for rank, (err, (received, shape)) in enumerate(results):
        assert err <= 1e-6
        tokens = routing(case, rank, world)[0].shape[0]
        assert shape == (tokens, HIDDEN)
        if case == "all-to-rank-0" and rank == 1:
            assert received == 0  # nothing was routed to rank 1's experts
    if case == "all-to-rank-0":
        assert results[0][1][0] == sum(routing(case, r, world)[0].shape[0] for r in range(2)) * 2
