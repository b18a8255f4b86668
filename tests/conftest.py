"""Shared fixtures: tiny random Hugging Face checkpoints of both families."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from moe_overlap.distributed.netns import LinkUnavailable, NetnsLink

if not torch.cuda.is_available():  # before any import of Triton: its kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")  # on CPU tensors (the FP8 kernels)
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


def pytest_collection_modifyitems(session, config, items) -> None:
    """Where the session holds the type check (tests/test_types.py), mypy starts now, niced,
    in the background: its 15 s of one core run where the tests leave a core idle, and the
    test only waits for what is left (it runs near the end of a whole run)."""
    if not any(item.nodeid.startswith("tests/test_types.py") for item in items):
        return
    cache = tempfile.mkdtemp(prefix="mypy-cache-")
    config.mypy_run = subprocess.Popen(
        [sys.executable, "-m", "mypy", "--cache-dir", cache],
        cwd=Path(__file__).resolve().parents[1],  # pyproject.toml names the files
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: os.nice(10),
    )


def pytest_unconfigure(config) -> None:
    run = getattr(config, "mypy_run", None)
    if run is not None and run.poll() is None:  # the session ended before its test
        run.kill()
        run.wait()


@pytest.fixture(scope="session")
def mypy_run(request) -> subprocess.Popen:
    """The background type check this session started (see pytest_collection_modifyitems)."""
    return request.config.mypy_run


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
