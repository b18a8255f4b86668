"""``bench --emulate-peers N``: one process plays rank 0 of ep=N through the unchanged model,
schemes and all-to-all dispatcher; its experts get as many rows as it sends, the link time is
the modelled link's for the rows that would cross, and bad layouts are refused."""

from __future__ import annotations

import json

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.core.workloads import Workload, make_batches, parse_workload
from moe_overlap.dispatch.emulated import EmulatedAllToAllDispatcher, symmetric_counts
from moe_overlap.distributed.emulated import EmulatedGroup
from moe_overlap.tools.bench import run_bench
from moe_overlap.tools.cli import main

CONFIG = "configs/qwen3-moe-tiny.json"
LINK = "model:400mbit,1ms"
MODES = ["none", "sbo", "dbo", "tbo", "tbo+two-chunk", "tbo+time-split", "tbo3+time-split"]
RAN = {"none": "none", "sbo": "sbo", "dbo": "dbo"}  # the rest run TBO
BENCH_MODES = [*MODES, "auto"]  # auto calibrates on the emulated rank, then picks per forward


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.from_hf(CONFIG)


@pytest.fixture(scope="module")
def rank0() -> Workload:
    """Rank 0's tokens of ep=2: above DBO's prefill threshold (512), several sequences."""
    w = parse_workload("uniform:20-300:600", 2, seed=0)
    return Workload(w.spec, w.lengths[:1])


@pytest.fixture(scope="module")
def llm(cfg):
    with LLM(config=cfg, emulate_peers=2, link=LINK, max_num_seqs=8, max_model_len=320) as e:
        yield e


def test_every_mode_runs_its_own_scheme_on_the_emulated_rank(llm, cfg, rank0):
    runner = llm.executor.runner
    assert isinstance(runner.dispatcher, EmulatedAllToAllDispatcher)
    assert runner.dispatcher.local == cfg.num_experts // 2  # rank 0's half of the experts
    batches = make_batches(rank0, cfg.vocab_size, 0)
    for mode in MODES:
        logits = llm.executor.run(batches, mode_config(mode)).logits[0]
        assert logits.shape == (len(rank0.lengths[0]), cfg.vocab_size)  # last rows
        assert torch.isfinite(logits).all(), mode
        assert runner.last_mode == RAN.get(mode, "tbo"), mode  # no silent fallback to none


def test_the_experts_receive_exactly_the_rows_the_rank_sends(llm, cfg, rank0, monkeypatch):
    dispatcher = llm.executor.runner.dispatcher
    seen: list[tuple[list[int], list[int], int]] = []
    dispatch_b = dispatcher.dispatch_b

    def counting(state):
        dispatch_b(state)
        seen.append((state.send, state.recv, sum(state.tokens_per_expert)))
        assert state.expert_inputs.shape[0] == sum(state.tokens_per_expert)

    monkeypatch.setattr(dispatcher, "dispatch_b", counting)
    group = dispatcher.group
    before = group.rows_sent, group.rows_received
    batches = make_batches(rank0, cfg.vocab_size, 0)
    for mode in ("none", "sbo", "tbo"):
        seen.clear()
        llm.executor.run(batches, mode_config(mode))
        assert seen, mode
        for send, recv, computed in seen:
            assert send == recv and recv[1] > 0  # from the peer as many rows as sent to it
            assert computed == sum(send)  # the local experts compute every row received
        routed = sum(rank0.lengths[0]) * cfg.num_experts_per_tok * cfg.num_hidden_layers
        assert sum(computed for _, _, computed in seen) == routed, mode
    sent, received = group.rows_sent - before[0], group.rows_received - before[1]
    assert sent == received > 0  # dispatch, combine and SBO's pieces alike


def test_t_comm_is_the_modelled_links_time_for_the_rows_that_cross(llm, cfg, rank0, monkeypatch):
    dispatcher = llm.executor.runner.dispatcher
    link, group = dispatcher.link, dispatcher.group
    reserved: list[int] = []
    reserve = link.reserve

    def spy(start, num_bytes):
        reserved.append(num_bytes)
        return reserve(start, num_bytes)

    monkeypatch.setattr(link, "reserve", spy)
    crossing = group.rows_to_peers
    report = run_bench(llm.executor, rank0, ["none"], 1, cfg.vocab_size, progress=False)
    forwards = 4  # warm-up, recorded, timed, and the T_comm forward: same tokens, same routes
    row_bytes = cfg.hidden_size * 4
    assert sum(reserved) == (group.rows_to_peers - crossing) * row_bytes  # only what crosses
    per_forward = len(reserved) // forwards
    assert per_forward == 2 * cfg.num_hidden_layers  # a dispatch and a combine per MoE layer
    link_s = sum(link.latency_s + b / link.bytes_per_s for b in reserved[:per_forward])
    assert reserved[:per_forward] * forwards == reserved
    assert report.t_comm == pytest.approx(link_s, rel=1e-6)  # each span ends when the link does
    assert report.t_comp == pytest.approx(report.t_none - report.t_comm)


def test_symmetric_counts_keep_each_peer_sending_back_what_it_gets():
    counts = torch.tensor([[3, 1], [0, 5], [2, 2]])  # rank 0 to rank p's two local experts
    everyone = symmetric_counts(counts)
    assert torch.equal(everyone[0], counts) and torch.equal(everyone[:, 0], counts)
    crossing = everyone.sum(0) - everyone.diagonal().T  # what each rank's experts get from others
    assert (crossing == crossing[0]).all()


def test_the_emulated_group_mirrors_rank_0():
    group = EmulatedGroup(4, torch.device("cpu"))
    assert group.size == 4 and group.rank == 0
    assert group.all_reduce(torch.tensor([2.0, 3.0])).tolist() == [8.0, 12.0]
    table = group.gather_columns(torch.tensor([5, 1]))
    assert table.tolist() == [[5] * 4, [1] * 4]
    with pytest.raises(ValueError, match="send back exactly"):
        group.all_to_all(torch.zeros(3, 2), [1, 1, 1, 0], [1, 2, 0, 0])


def test_the_emulated_bench_prints_every_modes_row(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the whole table on one line per mode
    out = tmp_path / "bench.json"
    argv = ["bench", "--hf-config", CONFIG, "--emulate-peers", "2", "--link", LINK]
    argv += ["--workload", "uniform:20-300:600", "--repeat", "1", "--modes", ",".join(BENCH_MODES)]
    assert main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    words = " ".join(printed.split())  # the title and caption wrap at the table's width
    assert "rank 0 of ep2" in words and "logits meaningless" in words
    for column in ("tokens/s", "speed-up", "hidden", "of limit", "of 0-host", "T_comp", "limit"):
        assert column in words
    rows = {line.split()[1]: line for line in printed.splitlines() if line.startswith("│")}
    assert set(rows) == set(BENCH_MODES)
    assert all(row.count("%") == 3 for row in rows.values())  # hidden, of limit, of 0-host
    data = json.loads(out.read_text())
    for mode, row in rows.items():  # the table's share of the bound is the JSON's
        share = data["modes"][mode]["zero_host_bound_share"]
        assert row.split("│")[-2].strip() == f"{share:.0%}"
    assert data["emulate_peers"] == 2 and data["tokens_per_forward"] == 600
    assert data["t_comm_s"] > 0 and set(data["modes"]) == set(BENCH_MODES)
    assert all(m["limit_share"] > 0 for m in data["modes"].values())


@pytest.mark.parametrize(
    ("layout", "peers", "flag"),
    [
        ({}, 1, "--emulate-peers=1: emulate an EP group of 2 or more"),
        ({}, -2, "--emulate-peers=-2"),
        ({"ep": 2}, 2, "--ep=2 with --emulate-peers 2"),
        ({"tp": 2}, 2, "--tp=2 with --emulate-peers 2"),
        ({"tp": 2, "dp": 2, "enable_dp_attention": True}, 2, "--tp=2 with"),
        ({"dp": 2}, 2, "--dp=2 with --emulate-peers 2"),
        ({"pp": 2}, 2, "--pp=2 with --emulate-peers 2"),
    ],
)
def test_emulation_refuses_layouts_it_cannot_emulate(layout, peers, flag):
    with pytest.raises(ConfigError, match=flag.replace("+", r"\+")):
        check_layout(ParallelConfig(**layout), emulate_peers=peers)


def test_emulation_refusals_name_the_fix(cfg):
    with pytest.raises(ConfigError, match=r"--emulate-peers=3 must divide num_experts=8"):
        check_layout(ParallelConfig(), cfg, emulate_peers=3)
    with pytest.raises(ConfigError, match="drop --enable-dp-attention"):
        check_layout(ParallelConfig(enable_dp_attention=True), emulate_peers=2)
    with pytest.raises(ConfigError, match="use --link model:"):
        check_layout(ParallelConfig(), link="netns:1gbit", emulate_peers=2)
    with pytest.raises(ConfigError, match="--enable-pdmux with --emulate-peers 2"):
        check_layout(ParallelConfig(), pdmux=True, emulate_peers=2)
    check_layout(ParallelConfig(), cfg, mode_config("dbo"), LINK, emulate_peers=2)  # legal
    with pytest.raises(ConfigError, match="--enable-dbo needs more than one rank"):
        check_layout(ParallelConfig(), cfg, mode_config("dbo"))  # without emulation: refused


def test_the_bench_refuses_bad_emulation_with_one_line(capsys):
    argv = ["bench", "--hf-config", CONFIG, "--repeat", "1", "--modes", "none"]
    assert main([*argv, "--emulate-peers", "3"]) == 2
    assert "--emulate-peers=3 must divide num_experts=8" in capsys.readouterr().err
    assert main([*argv, "--emulate-peers", "2", "--ep", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ep=2 with --emulate-peers 2" in err and "--modes" not in err
