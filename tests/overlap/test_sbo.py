"""Single-batch overlap: exact at ep=1 and ep=2, split combine arithmetic, structure on a timeline."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.dispatcher import balanced_blocks
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.dispatch.all_to_all import AllToAllDispatcher
from moe_overlap.dispatch.pieces import piece_layouts
from moe_overlap.distributed.link import parse_link
from moe_overlap.overlap.strategy import STRATEGIES
from moe_overlap.runtime.worker import RankSpec, build_rank_runner
from tests.dist_utils import init_gloo, run_workers
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same, force_overlap, reference


def sbo(blocks: int = 2, backend: str = "auto") -> OverlapConfig:
    return OverlapConfig("sbo", moe_a2a_backend=backend, sbo_combine_blocks=blocks)


# --- settings and the op order --------------------------------------------------------------


def test_settings_are_validated():
    with pytest.raises(ConfigError, match="--sbo-combine-blocks=0 must be an integer >= 1"):
        sbo(blocks=0)
    with pytest.raises(ConfigError, match="--sbo-comm-sms=0 must be an integer >= 1"):
        OverlapConfig("sbo", sbo_comm_sms=0)
    assert OverlapConfig("sbo").sbo_comm_sms == 3


def test_shared_experts_run_while_dispatch_is_in_flight():
    order = STRATEGIES["sbo", "deepseek", "prefill"].moe_ops.index
    assert order("dispatch_a") < order("shared_experts") < order("dispatch_b")
    assert order("dispatch_b") < order("experts_combine_a") < order("combine_b")


@given(
    rows=st.lists(st.integers(0, 50), min_size=1, max_size=9),
    blocks=st.integers(1, 10),
)
def test_balanced_blocks_partition_the_local_experts(rows, blocks):
    got = balanced_blocks(rows, blocks)
    assert len(got) == min(len(rows), blocks)  # never an all-to-all that cannot carry rows
    assert [e for r in got for e in r] == list(range(len(rows)))
    assert all(len(r) >= 1 for r in got)
    if not any(rows):  # no rows to balance: by expert count
        assert max(map(len, got)) - min(map(len, got)) <= 1


def test_balanced_blocks_even_the_rows_not_the_experts():
    # an even count of experts would leave 1500 of these 2285 rows in the last piece, the one
    # nothing hides
    assert balanced_blocks([350, 435, 700, 800], 2) == [range(0, 3), range(3, 4)]
    assert balanced_blocks([800, 700, 435, 350], 2) == [range(0, 1), range(1, 4)]
    assert balanced_blocks([1, 1, 1, 1, 96], 3) == [range(0, 3), range(3, 4), range(4, 5)]
    assert balanced_blocks([0, 0, 0, 0], 2) == [range(0, 2), range(2, 4)]


# --- the per-block split arithmetic, on fake ranks in one process --------------------------


def test_piece_layouts_by_hand():
    # 2 ranks x 3 local experts; rows grouped (rank, expert): r0: e0 e0 e2 | r1: e0 e1 e1 e1
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    pieces = [[range(1, 3)] * 2, [range(0, 1)] * 2]
    positions, cuts = piece_layouts(counts, pieces)
    assert positions.tolist() == [2, 4, 5, 6, 0, 1, 3]  # the first piece's, then the second's
    assert cuts == [(slice(0, 4), [1, 3]), (slice(4, 7), [2, 1])]
    # a source's view: each owner cut its experts where its own rows fell
    positions, cuts = piece_layouts(counts, [[range(0, 1), range(0, 2)]])
    assert positions.tolist() == [0, 1, 3, 4, 5, 6] and cuts == [(slice(0, 6), [2, 4])]


class _Done:
    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out

    def on_complete(self, callback):
        callback()


class _Hub:
    """The wire between fake ranks (threads): all_to_all swaps row chunks through a mailbox."""

    def __init__(self, size: int):
        self.size, self.box = size, {}
        self.barrier = threading.Barrier(size, timeout=20)

    def exchange(self, rank, rows, ins, outs):
        for dst, chunk in enumerate(rows.split(ins)):
            self.box[rank, dst] = chunk
        self.barrier.wait()
        got = [self.box[src, rank] for src in range(self.size)]
        self.barrier.wait()  # everyone has read before anyone writes the next exchange
        assert [len(g) for g in got] == outs, "splits disagree between sender and receiver"
        return torch.cat(got)


class _FakeGroup:
    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.device = torch.device("cpu")  # as Group's: where the dispatcher's streams live

    def all_to_all(self, rows, input_splits, output_splits, async_op=False):
        out = self.hub.exchange(self.rank, rows, list(input_splits), list(output_splits))
        return _Done(out) if async_op else out

    def all_gather(self, t):
        return self.hub.exchange(
            self.rank, t.repeat(self.size, 1), [1] * self.size, [1] * self.size
        )


def _fake_rank(hub, rank, local, blocks, tokens, results):
    torch.manual_seed(100 + rank)
    experts, hidden = hub.size * local, 4
    x = torch.randn(tokens, hidden)
    ids = torch.rand(tokens, experts).topk(2).indices
    weights = torch.rand(tokens, 2)
    disp = AllToAllDispatcher(_FakeGroup(hub, rank), experts)

    def layer(split: bool):
        state = disp.dispatch_a(x, ids, weights)
        disp.dispatch_b(state)
        # a fake expert: scale rows by their global expert id, so a misplaced row shows
        local_id = torch.arange(local).repeat_interleave(torch.tensor(state.tokens_per_expert))
        scale = (rank * local + local_id + 1).float().unsqueeze(1)
        state.expert_outputs = state.expert_inputs * scale
        if split:
            for b in range(len(disp.combine_blocks(state, blocks))):
                disp.combine_a_block(state, b)
        else:
            disp.combine_a(state)
        return disp.combine_b(state)

    expected = (x.unsqueeze(1) * (ids + 1).float().unsqueeze(-1) * weights.unsqueeze(-1)).sum(1)
    results[rank] = (layer(False), layer(True), expected)


@pytest.mark.parametrize("ranks,local,tokens", [(2, 2, 5), (3, 3, 7), (2, 4, 1), (3, 2, 0)])
@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
def test_split_combine_equals_unsplit_on_fake_ranks(ranks, local, tokens, blocks):
    hub, results, errors = _Hub(ranks), {}, []

    def run(rank):
        try:
            _fake_rank(hub, rank, local, blocks, tokens + rank, results)
        except BaseException as exc:  # reported below, after every thread stopped
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for unsplit, split, expected in results.values():
        assert torch.equal(split, unsplit)  # bit-identical, not just close
        torch.testing.assert_close(split, expected)


# --- exactness against the one-process, no-overlap run -------------------------------------


@pytest.mark.parametrize("family", sorted(TINY))
def test_ep1_matches_no_overlap(family):
    cfg = ModelConfig(**TINY[family])
    base = reference(cfg)
    for blocks in (3, 20):  # uneven blocks, and more blocks than experts
        with LLM(config=cfg, overlap=sbo(blocks, "local"), **KW) as llm:
            for case, prompts in CASES.items():
                assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


@pytest.fixture(scope="module", params=sorted(TINY))
def ep2(request):
    """(config, reference outputs, an ep=2 SBO engine) per family; the engine is shared."""
    cfg = ModelConfig(**TINY[request.param])
    base = reference(cfg)
    with LLM(config=cfg, ep=2, overlap=sbo(), **KW) as llm:
        yield cfg, base, llm


# 1 block (no split), the default, and more blocks than local experts (4 on DeepSeek, 2 on Qwen3)
@pytest.mark.parametrize("blocks", [1, 2, 7])
def test_ep2_matches_one_process(ep2, blocks, monkeypatch):
    cfg, base, llm = ep2
    force_overlap(llm, sbo(blocks), monkeypatch)
    for case, prompts in CASES.items():
        assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


# --- the overlap is structured as promised (order of launches and waits, not timings) --------


class _LoggedHandle:
    def __init__(self, handle, entry: dict):
        self.handle, self.entry = handle, entry

    def wait(self, *args):
        self.entry.setdefault("wait", time.perf_counter())  # when the caller first blocks
        return self.handle.wait(*args)

    def __getattr__(self, name):
        return getattr(self.handle, name)


class _LoggedGroup:
    """The EP group, logging when each async all-to-all is launched and first waited for."""

    def __init__(self, group, log: list[dict]):
        self.group, self.log = group, log
        self.rank, self.size = group.rank, group.size

    def all_to_all(self, rows, input_splits, output_splits, async_op=False):
        out = self.group.all_to_all(rows, input_splits, output_splits, async_op=async_op)
        self.log.append({"launch": time.perf_counter()})
        return _LoggedHandle(out, self.log[-1])

    def all_gather(self, t):
        return self.group.all_gather(t)  # the counts exchange


def _structure_worker(rank, world_size, port, family, blocks):
    init_gloo(rank, world_size, port)
    cfg = ModelConfig(**TINY[family])
    par = ParallelConfig(ep=world_size)
    spec = EngineSpec(cfg, seed=0, max_num_seqs=2, max_len=64, overlap=sbo(blocks), parallel=par)
    runner = build_rank_runner(spec, RankSpec(rank, world_size, "", 30.0, parse_link("none")))
    log: list[dict] = []
    runner.dispatcher.group = _LoggedGroup(runner.dispatcher.group, log)
    runner.dispatcher.timeline = None  # communication is logged above instead
    runner.timeline.enabled = True  # SBO's per-block compute spans
    tokens = 9 if rank == 0 else 3  # uneven on purpose
    runner.forward(ForwardBatch(torch.arange(tokens), [0], [0], [tokens]))
    return log, runner.timeline.take()


@pytest.mark.parametrize("family,blocks", [("deepseek_v3", 3), ("qwen3_moe", 2)])
def test_ep2_pieces_are_in_flight_while_later_blocks_compute(family, blocks):
    cfg = ModelConfig(**TINY[family])
    n_blocks = min(blocks, cfg.num_experts // 2)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for log, spans in run_workers(_structure_worker, 2, family, blocks):
        # per MoE layer: the dispatch, then one all-to-all per block of experts
        assert len(log) == len(moe_layers) * (1 + n_blocks)
        named = {s.name: s for s in spans if s.track == "mb0 sbo"}
        for n, layer in enumerate(moe_layers):
            dispatch, *pieces = log[n * (1 + n_blocks) : (n + 1) * (1 + n_blocks)]
            work = [named[f"layer {layer} experts {b}/{n_blocks}"] for b in range(n_blocks)]
            if cfg.n_shared_experts:  # shared experts compute while the dispatch is in flight
                shared = named[f"layer {layer} shared experts"]
                assert dispatch["launch"] <= shared.start <= shared.end <= dispatch["wait"]
            assert dispatch["wait"] <= work[0].start
            for b, piece in enumerate(pieces):
                assert work[b].end <= piece["launch"]  # a block's piece leaves once it is done
                if b + 1 < n_blocks:  # ... before the next block starts
                    assert piece["launch"] <= work[b + 1].start
                assert work[-1].end <= piece["wait"]  # and nobody waits until all are computed


@pytest.mark.parametrize("blocks", [2, 3])
def test_ep2_timeline_records_one_combine_piece_per_block(ep2, blocks):
    cfg, _, llm = ep2
    n_blocks = min(blocks, cfg.num_experts // 2)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    # KV slot 0 is free between generate calls
    batches = [ForwardBatch(torch.arange(n), [0], [0], [n]) for n in (9, 3)]
    for spans in llm.executor.run(batches, sbo(blocks), record=True).spans:
        comm = sorted((s for s in spans if s.track == "comm"), key=lambda s: s.start)
        pieces = [s for s in comm if s.name.startswith("combine")]
        assert all(s.name.startswith("combine piece") for s in pieces)  # no unsplit combine
        assert len(pieces) == n_blocks * len(moe_layers)
        named = {s.name: s for s in spans if s.track == "mb0 sbo"}
        for n, layer in enumerate(moe_layers):
            last_block = named[f"layer {layer} experts {n_blocks - 1}/{n_blocks}"]
            first_piece = pieces[n * n_blocks]
            assert first_piece.start < last_block.start or n_blocks == 1
