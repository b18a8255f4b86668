"""One process on one GPU: parity with transformers in fp32 and bf16, overlap modes exact
against no overlap, and the stream helpers holding the GPU, not the host."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest
import torch

from moe_overlap import LLM, ModelConfig, SamplingParams
from moe_overlap.distributed.streams import CommStream, MicroBatchStreams, consume
from moe_overlap.overlap.baton import DualBatchThreads
from moe_overlap.overlap.operations import Yield
from tests.gpu.common import needs_gpu
from tests.helpers import CASES, KW, PARAMS, TINY, assert_same
from tests.model.test_bf16 import PROMPTS, _near, _row_diffs

pytestmark = needs_gpu
pytest.importorskip("transformers")


def _hf_logits(hf, dtype: torch.dtype) -> list[torch.Tensor]:
    hf = copy.deepcopy(hf).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        return [hf(torch.tensor([p], device="cuda")).logits[0].float().cpu() for p in PROMPTS]


def test_fp32_matches_transformers_on_cuda(hf_checkpoint):
    _, path, hf = hf_checkpoint
    with LLM(path, device="cuda") as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_new_tokens=1), return_logits=True
        )
    for out, ref in zip(outs, _hf_logits(hf, torch.float32), strict=True):
        assert (out.prompt_logits - ref).abs().max().item() <= 1e-4


def test_bf16_matches_transformers_on_cuda(hf_checkpoint, tmp_path):
    _, _, hf = hf_checkpoint
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path)  # a bf16 checkpoint
    with LLM(tmp_path, device="cuda", dtype="bfloat16") as llm:
        outs = llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_new_tokens=1), return_logits=True
        )
    refs = _hf_logits(hf, torch.bfloat16)  # the same rounding as the saved checkpoint
    _near(_row_diffs([o.prompt_logits for o in outs], refs))


@pytest.mark.parametrize("family", sorted(TINY))
def test_one_process_modes_exact_on_cuda(family):
    cfg = ModelConfig(**TINY[family])
    with LLM(config=cfg, device="cuda", **KW) as llm:
        base = {c: llm.generate(p, PARAMS, return_logits=True) for c, p in CASES.items()}
    for mode in ("tbo", "sbo"):
        with LLM(config=cfg, device="cuda", overlap=mode, **KW) as llm:
            for case, prompts in CASES.items():
                assert_same(base[case], llm.generate(prompts, PARAMS, return_logits=True))


def test_comm_stream_delay_holds_neither_host_nor_compute():
    comm = CommStream(torch.device("cuda", torch.cuda.current_device()))
    comm.cycles_per_s()  # measured once, outside the timed part
    x = torch.randn(2048, 2048, device="cuda")
    x @ x  # CUDA loads a kernel on first use, lazily, and that waits for the sleeping stream
    torch.cuda.synchronize()
    start = time.perf_counter()
    with comm.launch():
        comm.delay(0.3)  # a modelled transfer of 300 ms
    done = comm.done()
    assert time.perf_counter() - start < 0.05  # the host did not wait
    y = x @ x
    torch.cuda.current_stream().synchronize()
    assert time.perf_counter() - start < 0.25  # nor did the compute stream
    assert not done.query()  # the communication stream is still held
    consume(done, y)
    y.sum().item()
    assert time.perf_counter() - start >= 0.29  # the consumer waited for the link


def test_a_modelled_link_runs_beside_a_real_transfer_not_after_it():
    """``--link model`` over a real transfer: the all-to-all ends at the later of the two, as
    on CPU, not after both (the delay used to start once the transfer had ended)."""
    comm = CommStream(torch.device("cuda", torch.cuda.current_device()))
    cycles = comm.cycles_per_s()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with comm.launch():
        torch.cuda._sleep(int(0.2 * cycles))  # the real transfer: 200 ms on the stream
        comm.delay(0.2)  # the modelled link: 200 ms from the same start
    comm.done().synchronize()
    assert 0.19 <= time.perf_counter() - start < 0.3  # not their sum, 0.4 s


def test_dbo_streams_keep_baton_order_on_the_gpu():
    """Micro-batch 1 reads what micro-batch 0 wrote in the segment before, on another stream:
    only the handover event makes it see the write (a long matmul precedes it)."""
    device = torch.device("cuda", torch.cuda.current_device())
    buf, big = torch.zeros(1, device=device), torch.randn(4096, 4096, device=device)

    def write(ctx, **kw):
        if ctx.index == 0:
            buf.copy_((big @ big @ big).sum().clamp(1, 1))  # slow, then 1.0
        return kw

    def read(ctx, **kw):
        return {"seen": buf.clone()} if ctx.index == 1 else kw

    ops = [write, Yield(), read]
    threads = DualBatchThreads(30, streams=MicroBatchStreams(device))
    try:
        ctxs = [SimpleNamespace(index=i, name=f"mb{i}") for i in (0, 1)]
        outs = threads.run(ctxs, ops, lambda ctx: lambda name: None)
    finally:
        threads.close()
    assert outs[1]["seen"].item() == 1.0
