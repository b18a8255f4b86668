"""``--model`` as a Hugging Face Hub id: resolved from the local cache, never downloaded."""

from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants

from moe_overlap import ModelConfig
from moe_overlap.core.errors import ConfigError
from moe_overlap.engine.engine_args import EngineArgs

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, qwen3_checkpoint):
    """A Hugging Face cache holding ``tiny-org/tiny-moe`` at ``main`` (the Hub's layout:
    ``models--ORG--NAME/refs/main`` names the snapshot under ``snapshots/``)."""
    repo = tmp_path / "models--tiny-org--tiny-moe"
    shutil.copytree(qwen3_checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return repo / "snapshots" / COMMIT


def test_a_cached_hub_id_is_its_snapshot(hub_cache):
    model, hf_config = EngineArgs.from_kwargs(model="tiny-org/tiny-moe").model_source()
    assert (model, hf_config) == (str(hub_cache), None)
    assert ModelConfig.from_hf(model) == ModelConfig.from_hf(hub_cache)
    dummy = EngineArgs.from_kwargs(model="tiny-org/tiny-moe", load_format="dummy")
    assert dummy.model_source() == (None, f"{hub_cache}/config.json")


def test_a_hub_id_not_in_the_cache_says_how_to_fetch_it(hub_cache):
    with pytest.raises(ConfigError, match=r"no snapshot of the Hub model 'Qwen/Qwen3-30B-A3B'"):
        EngineArgs.from_kwargs(model="Qwen/Qwen3-30B-A3B").model_source()
    with pytest.raises(ConfigError, match=r"hf download Qwen/Qwen3-30B-A3B"):
        EngineArgs.from_kwargs(model="Qwen/Qwen3-30B-A3B").model_source()


def test_a_directory_wins_over_a_hub_id(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "tiny-org" / "tiny-moe"
    shutil.copytree(hub_cache, local)
    monkeypatch.chdir(tmp_path)  # "tiny-org/tiny-moe" is now also a relative directory
    model, _ = EngineArgs.from_kwargs(model="tiny-org/tiny-moe").model_source()
    assert model == "tiny-org/tiny-moe"
