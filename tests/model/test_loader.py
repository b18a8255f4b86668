"""Checkpoints: round trip, per-rank shards, and clear errors for broken files."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_overlap import ModelConfig
from moe_overlap.distributed.groups import Group
from moe_overlap.model.loader import CheckpointError, build_model, save_checkpoint
from moe_overlap.model.tensor_parallel import ModelParallel
from tests.helpers import qwen3_hf_config


@pytest.fixture
def saved(tmp_path):
    cfg = ModelConfig.from_hf(qwen3_hf_config().to_dict())
    model = build_model(cfg, seed=3)
    save_checkpoint(model, tmp_path / "ckpt")
    return cfg, model, tmp_path / "ckpt"


def test_round_trip_and_hub_layout(saved):
    cfg, model, path = saved
    names = load_file(path / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    loaded = build_model(ModelConfig.from_hf(path), path)
    for (n, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_expert_shards_match_the_whole_model(saved):
    cfg, model, path = saved
    whole = model.layers[0].mlp.experts
    inter = whole.intermediate
    for ep_rank, moe_tp_rank in ((0, 0), (1, 0), (1, 1)):
        par = ModelParallel(Group.single(), ep_rank, 2, moe_tp_rank, 2)
        for shard in (build_model(cfg, path, par=par), build_model(cfg, seed=3, par=par)):
            bank = shard.layers[0].mlp.experts
            assert (bank.first, bank.count, bank.intermediate) == (4 * ep_rank, 4, inter // 2)
            mine = slice(moe_tp_rank * inter // 2, (moe_tp_rank + 1) * inter // 2)
            experts = slice(bank.first, bank.first + 4)
            assert torch.equal(bank.down_proj, whole.down_proj[experts, :, mine])
            gate, up = bank.gate_up_proj.split(inter // 2, dim=1)
            assert torch.equal(gate, whole.gate_up_proj[experts, :inter][:, mine])
            assert torch.equal(up, whole.gate_up_proj[experts, inter:][:, mine])


def test_missing_tensor_is_named(saved):
    cfg, _, path = saved
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"'model.layers.2.mlp.experts.5.up_proj.weight' is missing"
    ):
        build_model(cfg, path)


def test_wrong_shape_is_named(saved):
    cfg, _, path = saved
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"'model.norm.weight' in model.safetensors has shape \(31,\), expected \(32,\)",
    ):
        build_model(cfg, path)


def test_truncated_file_is_named(saved, tmp_path):
    cfg, _, path = saved
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        build_model(cfg, path)


def test_empty_directory(saved, tmp_path):
    cfg, _, path = saved
    empty = tmp_path / "empty"
    shutil.copytree(path, empty, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        build_model(cfg, empty)
