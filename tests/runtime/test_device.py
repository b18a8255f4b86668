"""--device and --dtype on a machine without a GPU: the choices, the errors, auto's dtype, and that the
CUDA-only stream helpers do nothing on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_overlap import LLM, ConfigError, ModelConfig
from moe_overlap.core.device import (
    DTYPE_HELP,
    checkpoint_dtype,
    dist_backend,
    rank_device,
    resolve_device,
    resolve_dtype,
    torch_dtype,
)
from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.dispatch.local import LocalDispatcher
from moe_overlap.distributed.streams import CommStream, MicroBatchStreams, consume
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.model.loader import build_model, model_placement
from moe_overlap.runtime.model_runner import ModelRunner
from tests.helpers import TINY


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_auto_takes_cuda_only_when_every_rank_gets_a_gpu(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_device("auto", 1) == "cpu"
    _gpus(monkeypatch, 1)
    assert resolve_device("auto", 1) == "cuda"
    assert resolve_device("auto", 2) == "cpu"  # NCCL: never two ranks on one GPU
    _gpus(monkeypatch, 2)
    assert resolve_device("auto", 2) == "cuda"


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"--device cuda: no CUDA device .* use --device cpu"):
        resolve_device("cuda", 1)
    _gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"one GPU per rank: 2 ranks .* 1 GPU"):
        resolve_device("cuda", 2)
    with pytest.raises(ConfigError, match="--device='tpu'"):
        resolve_device("tpu", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_llm_asks_for_cuda_here():
    with pytest.raises(ConfigError, match="--device cuda"):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), device="cuda")


def test_dtype_names_and_errors():
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("float32") is torch.float32
    with pytest.raises(ConfigError, match="--dtype='fp8'"):
        torch_dtype("fp8")
    with pytest.raises(ConfigError, match="--dtype"):
        LLM(config=ModelConfig(**TINY["qwen3_moe"]), dtype="float16")


def test_dtype_auto_is_the_checkpoints_on_a_gpu_and_float32_on_cpu(tmp_path):
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cuda", "float32") == "float32"
    assert resolve_dtype("auto", "cuda", "float16") == "bfloat16"  # not served: the GPU default
    assert resolve_dtype("auto", "cuda", None) == "float32"  # seeded weights, named none
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_dtype("bfloat16", "cpu", "float32") == "bfloat16"  # asked for: kept
    with pytest.raises(ConfigError, match="--dtype='fp8' must be one of auto, float32"):
        resolve_dtype("fp8", "cpu")
    assert checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"  # transformers 4's key
    assert checkpoint_dtype({"dtype": "float32", "torch_dtype": "bfloat16"}) == "float32"
    assert checkpoint_dtype({"text_config": {"dtype": "bfloat16"}}) == "bfloat16"
    assert checkpoint_dtype({}) is None
    assert EngineArgs().dtype == "auto" and "on CPU float32" in DTYPE_HELP
    named = json.loads(Path("configs/qwen3-moe-tiny.json").read_text()) | {"dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(named))
    with LLM(hf_config=str(tmp_path / "config.json"), seed=0) as llm:  # the default on CPU
        assert llm.spec.dtype == llm.args.dtype == "float32"


def test_backend_and_rank_device_follow_the_device():
    assert dist_backend("cpu") == "gloo"
    assert dist_backend("cuda") == "cpu:gloo,cuda:nccl"  # NCCL data plane, gloo control
    assert rank_device("cuda", 3) == torch.device("cuda", 3)
    assert rank_device("cpu", 3) == torch.device("cpu")


def test_bf16_kv_cache_budget_holds_twice_the_pages():
    cfg = ModelConfig(**TINY["qwen3_moe"])
    fp32 = EngineSpec(cfg, max_len=64, kv_cache_bytes=2**16, max_num_seqs=10**6)
    bf16 = EngineSpec(cfg, max_len=64, kv_cache_bytes=2**16, max_num_seqs=10**6, dtype="bfloat16")
    assert bf16.slot_bytes * 2 == fp32.slot_bytes
    assert bf16.num_pages == 2 * fp32.num_pages


def test_bf16_model_keeps_routers_and_rope_in_fp32():
    cfg = ModelConfig(**TINY["deepseek_v3"])
    model = build_model(cfg, seed=0, dtype=torch.bfloat16)
    layer = model.layers[1]  # a MoE layer
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert layer.self_attn.rotary.inv_freq.dtype == torch.float32
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    assert model_placement(model) == (torch.device("cpu"), torch.bfloat16)
    runner = ModelRunner(model, LocalDispatcher(cfg.num_experts), 2, 16)
    assert runner.kv_cache.dtype == torch.bfloat16  # the cache follows the model


def test_stream_helpers_are_no_ops_on_cpu():
    comm = CommStream(torch.device("cpu"))
    with comm.launch():
        comm.delay(10.0)  # would hold a CUDA stream; here returns at once
    assert not comm.on_gpu and comm.done() is None
    t = torch.ones(3)
    assert consume(None, t) is t
    streams = MicroBatchStreams(torch.device("cpu"))
    streams.begin()
    with streams.on(1):
        streams.hand_over(1)
        streams.take_over(0)
    streams.end()
    assert streams.streams is None
