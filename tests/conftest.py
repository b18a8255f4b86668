"""Shared fixtures: tiny random Hugging Face checkpoints of both families."""

from __future__ import annotations

import pytest

from tests.helpers import deepseek_hf_config, qwen3_hf_config, save_hf_model


@pytest.fixture(scope="session", params=["qwen3_moe", "deepseek_v3"])
def hf_checkpoint(request, tmp_path_factory):
    """(family, directory, the transformers model) for each family."""
    make = qwen3_hf_config if request.param == "qwen3_moe" else deepseek_hf_config
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_hf_model(make(), path)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_small")
    save_hf_model(qwen3_hf_config(), path)
    return path
