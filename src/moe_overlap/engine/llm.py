"""The public entry point: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from rich.progress import Progress

from moe_overlap.core.device import ranks_on_this_node, resolve_device, torch_dtype
from moe_overlap.core.engine_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    EngineSpec,
)
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig, check_model_fits
from moe_overlap.distributed.layout import layout_for
from moe_overlap.distributed.link import LinkSpec, parse_link
from moe_overlap.engine.detokenize import TextStream
from moe_overlap.engine.layout_checks import check_layout, check_pdmux
from moe_overlap.engine.load_balance import DEFAULT_LOAD_BALANCE_METHOD, check_method
from moe_overlap.engine.pdmux import DEFAULT_PREFILL_SPLITS, PrefillWaves
from moe_overlap.engine.request import InvalidRequestError, Request, RequestOutput, SamplingParams
from moe_overlap.engine.scheduler import Scheduler
from moe_overlap.engine.tokenizer import load_tokenizer
from moe_overlap.runtime.launch import start_executor


class LLM:
    """An MoE inference engine over SGLang's layouts: ``tp`` tensor-parallel ranks, cut into
    ``dp`` attention-DP groups with ``enable_dp_attention``, experts sharded ``ep`` ways inside
    them; ``tp=1, ep=N`` is pure expert parallelism over N ranks; all 1 is this process only.

    ``LLM("path/to/model_dir")`` loads a Hugging Face checkpoint, and its tokenizer when the
    directory has a tokenizer.json (``tokenizer`` names another directory); ``LLM(config=cfg,
    seed=0)`` builds seeded random weights. ``device``: cpu, cuda (each rank on
    ``cuda:<local rank>``) or auto; ``dtype``: float32 (the exactness reference) or bfloat16.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: ModelConfig | None = None,
        seed: int = 0,
        tp: int = 1,
        dp: int = 1,
        ep: int = 1,
        enable_dp_attention: bool = False,
        pp: int = 1,
        enable_pdmux: bool = False,
        pdmux_prefill_splits: int = DEFAULT_PREFILL_SPLITS,
        load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        overlap: str | OverlapConfig = "none",
        link: str = "none",
        timeout_s: float = 60.0,
        tokenizer: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        if (model is None) == (config is None):
            raise ConfigError("give exactly one of a model directory or config=ModelConfig(...)")
        cfg = config or ModelConfig.from_hf(model)
        for name, value in (("max_num_seqs", max_num_seqs), ("seed", seed)):
            _check_int(name, value, minimum=0 if name == "seed" else 1)
        _check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        if max_model_len is not None:
            _check_int("max_model_len", max_model_len, minimum=1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise ConfigError(f"--timeout={timeout_s!r} must be a number of seconds")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"--timeout={timeout_s!r} must be a positive number of seconds")
        par = ParallelConfig(tp, dp, ep, enable_dp_attention, pp)
        check_method(load_balance_method)
        torch_dtype(dtype)
        device = resolve_device(device, ranks_on_this_node(par.world_size))
        layout_for(par)  # SGLang's refusals, naming the flags
        check_model_fits(cfg, par)
        if isinstance(overlap, str):
            overlap = OverlapConfig(mode=overlap)
        link_spec = _parse_link(link)
        check_layout(par, overlap, link_spec)
        check_pdmux(enable_pdmux, pdmux_prefill_splits, par, overlap)
        if enable_pdmux and cfg.is_hybrid:  # the prefill lane has no recurrent-state cache
            raise ConfigError(f"--enable-pdmux does not support model_type={cfg.model_type}")
        max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.config, self.seed, self.max_len = cfg, seed, max_len
        self.tokenizer = load_tokenizer(tokenizer or model, cfg.vocab_size)
        spec = EngineSpec(
            cfg,
            str(model) if model is not None else None,
            seed,
            max_num_seqs,
            max_len,
            overlap,
            parallel=par,
            device=device,
            dtype=dtype,
        )
        spec.pdmux_splits = pdmux_prefill_splits if enable_pdmux else 0
        self.spec, self.parallel = spec, par
        self.executor = start_executor(spec, link_spec, float(timeout_s))
        self.scheduler = Scheduler(  # one queue per attention-DP group, as many slots as its cache
            self.executor.num_dp,
            spec.kv_slots,
            max_len,
            max_num_batched_tokens,
            cfg.eos_token_id,
            load_balance_method,
            PrefillWaves(cfg.num_hidden_layers, pdmux_prefill_splits, max_num_batched_tokens)
            if enable_pdmux
            else None,
        )
        self._next_id = 0

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        return_logits: bool = False,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs come back in prompt
        order, with their text when the model has a tokenizer.

        All prompts are checked before anything runs: a bad one raises InvalidRequestError
        naming it. A call that fails or is interrupted (Ctrl-C) drops its requests, so the
        engine is left as it was before the call.
        """
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts must be a list of prompts (text or token ids)")
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if not self.executor.is_driver:  # a torchrun rank > 0
            self.executor.serve()
            return []
        try:
            requests = [
                self.make_request(f"prompt {i}", p, sp, return_logits)
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            return self._run(requests, progress)
        finally:
            self.executor.end_generate()  # releases torchrun ranks > 0

    def _run(self, requests: list[Request], progress: bool) -> list[RequestOutput]:
        done: dict[int, Request] = {}
        try:
            for req in requests:
                self.scheduler.add(req)
            with Progress(disable=not progress, transient=True) as bar:
                task = bar.add_task("generating", total=len(requests))
                while self.scheduler.has_work():
                    for req in self.step():
                        if req.finish_reason:
                            done[req.request_id] = req
                            bar.advance(task)
        except BaseException:
            self.scheduler.abort(requests)
            raise
        return [done[req.request_id].to_output() for req in requests]

    def step(self) -> list[Request]:
        """Run one forward of every running request; return those that got a token (the
        finished ones have ``finish_reason`` set and have left the scheduler)."""
        step = self.scheduler.schedule()
        logits = self.executor.run(step.batches, prefill=step.prefill)
        self.scheduler.update(step, logits, self.executor.last_prefill)
        return step.sampled  # a prefill wave's requests get their first token with its last range

    def make_request(
        self, where: str, prompt: str | Sequence[int], params: SamplingParams, return_logits=False
    ) -> Request:
        """A checked request, not yet scheduled; InvalidRequestError names ``where`` if bad."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{where}: params must be SamplingParams, not {params!r}")
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError(f"{where}: stop strings need a model with a tokenizer")
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = _token_ids(where, prompt)
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
        text = TextStream(self.tokenizer, params.stop) if self.tokenizer is not None else None
        gen = torch.Generator().manual_seed(seed)
        return Request(self._next_id, ids, params, return_logits, generator=gen, text=text)

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _token_ids(where: str, prompt: object) -> list[int]:
    """The prompt's ids as ints; anything but a sequence of integers is refused, not converted."""
    if isinstance(prompt, torch.Tensor | np.ndarray):
        if prompt.ndim != 1 or not _integer_dtype(prompt.dtype):
            raise InvalidRequestError(
                f"{where} must be a 1-D integer array, got {prompt.ndim}-D {prompt.dtype}"
            )
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence):
        note = " (the model has no tokenizer for text)" if isinstance(prompt, str) else ""
        raise InvalidRequestError(
            f"{where} must be a list of token ids, not {type(prompt).__name__} {prompt!r:.40}"
            + note
        )
    bad = [t for t in prompt if not _is_integer(t)]
    if bad:
        raise InvalidRequestError(
            f"{where} holds {bad[0]!r} ({type(bad[0]).__name__}); token ids must be integers"
        )
    return [int(t) for t in prompt]


def _integer_dtype(dtype: torch.dtype | np.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return dtype.kind in "iu"


def _is_integer(value: object) -> bool:
    """An int, a NumPy integer or a 0-D integer tensor; never a bool, float or string."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim == 0 and _integer_dtype(value.dtype)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')}={value!r} must be an integer >= {minimum}")


def _parse_link(link: object) -> LinkSpec:
    try:
        return parse_link(link)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
