"""The low-latency dispatch reads nothing back: over ``bench --emulate-peers 8 --a2a-mode
low_latency`` (the tiny model, fp32 on CPU) a whole step makes one host read, the sampled ids,
in none, tbo+two-chunk and sbo, for decode and prefill under the capacity. The normal
dispatch's reads per layer, counted the same way, show the counter sees them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_overlap import LLM, ModelConfig
from moe_overlap.core.mode_labels import mode_config
from moe_overlap.core.transfer import host_values
from moe_overlap.core.workloads import Workload, make_batches, parse_workload
from moe_overlap.tools.bench import fill_context, step
from moe_overlap.tools.host_reads import HostReads

CONFIG = "configs/qwen3-moe-tiny.json"
MODES = ("none", "tbo+two-chunk", "sbo")


@pytest.fixture(scope="module", params=["decode:64:32", "single-long:128"])
def bench(request):
    cfg = ModelConfig.from_hf(CONFIG)
    spec = parse_workload(request.param, 8)
    workload = Workload(spec.spec, spec.lengths[:1], spec.context)  # rank 0's, as the bench
    with LLM(
        config=cfg,
        emulate_peers=8,
        link="model:100gbit,20us",
        max_num_seqs=64,
        max_model_len=256,
    ) as llm:
        fill_context(llm.executor, workload, cfg.vocab_size, 0)
        yield llm, make_batches(workload, cfg.vocab_size, 0)


def _reads(bench, mode: str, a2a: str) -> HostReads:
    llm, batches = bench
    overlap = replace(mode_config(mode), a2a_mode=a2a, num_max_dispatch_tokens_per_rank=128)
    step(llm.executor, batches, overlap)  # warm-up: schemes and dispatchers built
    with HostReads() as reads:
        step(llm.executor, batches, overlap)
    return reads


@pytest.mark.parametrize("mode", MODES)
def test_a_low_latency_step_reads_the_host_once(bench, mode):
    reads = _reads(bench, mode, "low_latency")
    assert reads.total == 1, dict(reads.by_kind)  # the sampled ids
    layers = ModelConfig.from_hf(CONFIG).num_hidden_layers
    assert _reads(bench, mode, "normal").total > layers  # at least one per dispatch


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.sum().item(),
        lambda t: int(t.max()),
        lambda t: bool(t.any()),
        lambda t: t.tolist(),
        lambda t: t.nonzero(),
        lambda t: t[t > 0],
        lambda t: t.repeat_interleave(t),
        lambda t: t.numpy(),
    ],
)
def test_the_counter_counts_each_kind_of_read(read):
    with HostReads() as reads:
        read(torch.ones(4, dtype=torch.long))
    assert reads.total == 1


def test_what_the_counter_leaves_out():
    t = torch.ones(4, dtype=torch.long)
    with HostReads() as reads:
        t.repeat_interleave(t, output_size=4)  # sized by the host
        host_values(t)  # a host tensor, said to be one
    assert reads.total == 0
    with pytest.raises(ValueError, match="a read of the device"):
        host_values(torch.ones(2, device="meta"))
