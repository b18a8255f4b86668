"""Start the executor a layout needs: one process, spawned ranks, or a torchrun launch."""

from __future__ import annotations

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.local import LocalExecutor
from moe_overlap.runtime.spawn import SpawnedExecutor
from moe_overlap.runtime.torchrun import TorchrunExecutor, launched_by_torchrun


def start_executor(spec: EngineSpec, link: LinkSpec, timeout_s: float) -> Executor:
    if spec.parallel.world_size == 1:
        return LocalExecutor(spec, link)
    if launched_by_torchrun():
        return TorchrunExecutor(spec, link, timeout_s)
    return SpawnedExecutor(spec, link, timeout_s)
