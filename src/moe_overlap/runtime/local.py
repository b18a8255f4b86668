"""The one-process executor: this process holds every expert and nothing is communicated, or
(``bench --emulate-peers``) it is rank 0 of an EP group whose peers are emulated."""

from __future__ import annotations

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.step import StepReply, StepRequest
from moe_overlap.distributed.link import LinkSpec
from moe_overlap.runtime.executor import Executor
from moe_overlap.runtime.expert_load import expert_load
from moe_overlap.runtime.model_runner import ModelRunner
from moe_overlap.runtime.rank import build_rank_runner, serve_step
from moe_overlap.runtime.spawn import RankFailure


class LocalExecutor(Executor):
    num_ranks = num_dp = 1

    def __init__(self, spec: EngineSpec, link: LinkSpec | None = None):
        self._runner: ModelRunner | None = build_rank_runner(spec, link_spec=link)

    @property
    def runner(self) -> ModelRunner:
        """The rank's model; a closed engine refuses, as the spawned ranks' does."""
        if self._runner is None:
            raise RankFailure("the engine was stopped (closed, or a rank failed earlier)")
        return self._runner

    def step(self, request: StepRequest) -> StepReply:
        reply, spans, wave = serve_step(self.runner, request, 0, answers=True)
        assert reply is not None  # the one rank answers
        return StepReply([reply], [spans], None if wave is None else [wave])

    def expert_load(self, action: str) -> list[dict[int, list[int]] | None]:
        return [expert_load(self.runner.model, action)]

    def health(self) -> str | None:
        return None if self._runner is not None else "the engine was closed"

    def close(self) -> None:
        self._runner = None  # frees the weights; a later step is refused
