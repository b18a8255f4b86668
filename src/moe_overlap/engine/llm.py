"""The public entry point: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from rich.progress import Progress

from moe_overlap.config import ConfigError, ModelConfig, OverlapConfig
from moe_overlap.engine.executor import EngineSpec, LocalExecutor
from moe_overlap.engine.request import InvalidRequestError, Request, RequestOutput, SamplingParams
from moe_overlap.engine.scheduler import Scheduler


class LLM:
    """An MoE inference engine over ``ep`` expert-parallel ranks (1 = this process only).

    ``LLM("path/to/model_dir")`` loads a Hugging Face checkpoint; ``LLM(config=cfg, seed=0)``
    builds seeded random weights.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: ModelConfig | None = None,
        seed: int = 0,
        ep: int = 1,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        overlap: str | OverlapConfig = "none",
        link: str = "none",
        timeout_s: float = 60.0,
    ):
        if (model is None) == (config is None):
            raise ConfigError("give exactly one of a model directory or config=ModelConfig(...)")
        cfg = config or ModelConfig.from_hf(model)
        max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if not isinstance(ep, int) or ep < 1 or cfg.num_experts % ep:
            raise ConfigError(
                f"--ep={ep} must be a positive divisor of num_experts={cfg.num_experts}"
            )
        if isinstance(overlap, str):
            overlap = OverlapConfig(mode=overlap, moe_a2a_backend="local" if ep == 1 else "torch")
        _check_layout(ep, overlap, link)
        self.config, self.seed, self.max_len = cfg, seed, max_len
        spec = EngineSpec(
            cfg, str(model) if model is not None else None, seed, max_num_seqs, max_len, overlap
        )
        self.executor = _make_executor(spec, ep, link, timeout_s)
        self.scheduler = Scheduler(
            self.executor.num_ranks, max_num_seqs, max_len, max_num_batched_tokens, cfg.eos_token_id
        )
        self._next_id = 0

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        return_logits: bool = False,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (lists of token ids); outputs come back in prompt order.

        All prompts are checked before anything runs: a bad one raises InvalidRequestError
        naming it, and the engine is left as it was.
        """
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if not getattr(self.executor, "is_driver", True):  # a torchrun rank > 0
            self.executor.serve()
            return []
        try:
            requests = [
                self._make_request(i, p, sp, return_logits)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            return self._run(requests, progress)
        finally:
            if hasattr(self.executor, "end_generate"):  # release torchrun ranks > 0
                self.executor.end_generate()

    def _run(self, requests: list[Request], progress: bool) -> list[RequestOutput]:
        for req in requests:
            self.scheduler.add(req)
        done: dict[int, Request] = {}
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(requests))
            while self.scheduler.has_work():
                step = self.scheduler.schedule()
                for req in self.scheduler.update(step, self.executor.run(step.batches)):
                    done[req.request_id] = req
                    bar.advance(task)
        return [done[req.request_id].to_output() for req in requests]

    def _make_request(
        self, index: int, prompt: Sequence[int], params: SamplingParams, return_logits: bool
    ) -> Request:
        ids = [int(t) for t in prompt]
        where = f"prompt {index}"
        if not ids:
            raise InvalidRequestError(f"{where} is empty; give at least one token id")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{where} has token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})"
            )
        if len(ids) > self.max_len:
            raise InvalidRequestError(
                f"{where} has {len(ids)} tokens, longer than the model's context of {self.max_len}"
            )
        seed = params.seed if params.seed is not None else self.seed + self._next_id
        self._next_id += 1
        return Request(
            self._next_id, ids, params, return_logits, generator=torch.Generator().manual_seed(seed)
        )

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_layout(ep: int, overlap: OverlapConfig, link: str) -> None:
    """The reference systems' refusals, each with the fix."""
    if ep == 1 and overlap.moe_a2a_backend == "torch":
        raise ConfigError("--moe-a2a-backend=torch needs --ep > 1; use local on one process")
    if ep > 1 and overlap.moe_a2a_backend != "torch":
        raise ConfigError(
            f"--ep={ep} needs --moe-a2a-backend=torch, not {overlap.moe_a2a_backend!r}"
        )
    if overlap.mode == "dbo" and ep == 1:
        raise ConfigError("--enable-dbo needs data/expert parallelism > 1; set --ep 2 or more")
    if ep == 1 and link != "none":
        raise ConfigError(f"--link {link} needs --ep > 1: one process has no link to emulate")


def _make_executor(spec: EngineSpec, ep: int, link: str, timeout_s: float):
    if ep == 1:
        return LocalExecutor(spec)
    from moe_overlap.distributed.torchrun import TorchrunExecutor, launched_by_torchrun

    if launched_by_torchrun():
        return TorchrunExecutor(spec, ep, link, timeout_s)
    from moe_overlap.distributed.launch import SpawnedExecutor

    return SpawnedExecutor(spec, ep, link, timeout_s)
