"""Shared fixtures: tiny random Hugging Face checkpoints of both families."""

from __future__ import annotations

import signal

import pytest
import torch

from moe_overlap.distributed.netns import LinkUnavailable, NetnsLink
from tests.helpers import deepseek_hf_config, qwen3_hf_config, save_hf_model


def pytest_configure(config) -> None:
    """A shell starts a background job with SIGINT ignored, and every process it starts
    inherits that; the tests that press Ctrl-C (here and in the servers they start) need
    Python's own handler, which a started process then resets to the default."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # One intra-op thread in this process, as each spawned rank has: the tiny models gain
    # nothing from a second, and while any other process holds a core, a second thread's
    # spin at every parallel region's barrier made a one-process engine test 30-40x slower
    # (tests/overlap/test_overlap_one_process.py: 31 s against 0.8 s at a load of 1.8).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skip unless shaped network namespaces can be built here (a real attempt decides: root
    alone does not guarantee namespaces or tbf)."""
    try:
        with NetnsLink(1, "100mbit", prefix="moeoprobe"):
            pass
    except LinkUnavailable as error:
        pytest.skip(f"network namespaces not permitted here: {error}")


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
