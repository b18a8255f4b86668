"""The public entry point: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.progress import Progress

from moe_overlap.core.device import checkpoint_dtype, resolve_dtype
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.hf_config import read_json
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.step import StepReply, StepRequest
from moe_overlap.engine.args import BenchArgs
from moe_overlap.engine.candidates import candidates, chosen
from moe_overlap.engine.detokenize import TextStream
from moe_overlap.engine.engine_args import EngineArgs, overlap_knobs
from moe_overlap.engine.engine_spec import engine_spec
from moe_overlap.engine.errors import prompt_ids
from moe_overlap.engine.expert_distribution import ExpertRecorder
from moe_overlap.engine.layout_checks import check_settings
from moe_overlap.engine.online_eplb import OnlineEplb
from moe_overlap.engine.pdmux import PrefillWaves
from moe_overlap.engine.request import InvalidRequestError, Request, RequestOutput, SamplingParams
from moe_overlap.engine.scheduler import Scheduler
from moe_overlap.engine.speculation import Speculation
from moe_overlap.engine.structured import Constraints
from moe_overlap.engine.tokenizer import load_tokenizer, with_chat_template
from moe_overlap.model.quant_config import check_quantization, quant_config_of
from moe_overlap.runtime.launch import start_executor

# text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}
Prompt = str | Sequence[int] | dict[str, Any]


def _settled_dtype(args: EngineArgs, device: str, model: str | None) -> EngineArgs:
    """``args`` with ``--dtype auto`` resolved for ``device`` and ``model`` (or --hf-config)."""
    source = model if model is not None else args.hf_config
    checkpoint = checkpoint_dtype(read_json(source)) if source is not None else None
    return dataclasses.replace(args, dtype=resolve_dtype(args.dtype, device, checkpoint))


class LLM(ExpertRecorder):
    """An MoE inference engine over SGLang's layouts: ``tp`` tensor-parallel ranks, cut into
    ``dp`` attention-DP groups with ``enable_dp_attention``, experts sharded ``ep`` ways inside
    them; ``tp=1, ep=N`` is pure expert parallelism over N ranks; all 1 is this process only.

    ``LLM("path/to/model_dir")`` loads a Hugging Face checkpoint, and its tokenizer when the
    directory has a tokenizer.json (``tokenizer`` names another directory); ``LLM(config=cfg,
    seed=0)`` builds seeded random weights. ``device``: cpu, cuda (each rank on
    ``cuda:<local rank>``) or auto; ``dtype``: float32 (the exactness reference), bfloat16, or
    auto (the default: the checkpoint's dtype on a GPU, float32 on CPU or where it names none).

    The keyword arguments are ``EngineArgs``'s fields, the command line's flags with ``_`` for
    ``-`` (``max_num_seqs``, ``enable_two_batch_overlap``, ``load_format``, ...), SGLang's and
    vLLM's names too (``tensor_parallel_size``, ``context_length``); ``overlap`` may also be a
    whole ``OverlapConfig``, and ``timeout_s`` is ``timeout``. ``emulate_peers`` N (the bench's
    ``--emulate-peers``): this one process is rank 0 of ``ep=N``, its peers emulated; its
    logits mean nothing, its timing is the point.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        config: ModelConfig | None = None,
        tokenizer: str | Path | None = None,
        timeout_s: float | None = None,
        emulate_peers: int = BenchArgs.emulate_peers,
        **settings: Any,
    ):
        overlap = settings.pop("overlap", None)
        if isinstance(overlap, OverlapConfig):  # a whole config: the overlap knobs are its own
            _refuse_knobs_beside(settings)
            settings["overlap"] = None
        elif overlap is not None:
            settings["overlap"] = overlap
        if timeout_s is not None:  # the name before --timeout's settings field
            settings["timeout"] = timeout_s
        args = EngineArgs.from_kwargs(model=None if model is None else str(model), **settings)
        if config is not None:
            if not isinstance(config, ModelConfig):
                raise ConfigError(
                    f"config={config!r} must be a ModelConfig; for a config.json give "
                    "hf_config=PATH (seeded weights) or config=ModelConfig.from_hf(PATH)"
                )
            if model is not None or args.hf_config is not None:
                raise ConfigError(
                    "give exactly one of a model directory or config=ModelConfig(...)"
                )
            cfg, model = config, None
        else:
            model, hf_config = args.model_source()
            source = model or hf_config
            assert source is not None  # model_source gives one of the two
            cfg = ModelConfig.from_hf(source)
            quant = quant_config_of(read_json(model), model) if model is not None else None
            # before any rank starts
            check_quantization(args.quantization, quant, source, seeded=model is None)
        if not isinstance(overlap, OverlapConfig):
            overlap = args.overlap_config()
        self._ids = itertools.count(1)  # one next() each: make_request runs on many threads
        self._start(args, cfg, model, overlap, tokenizer, emulate_peers)

    def _start(
        self,
        args: EngineArgs,
        cfg: ModelConfig,
        model: str | None,
        overlap: OverlapConfig,
        tokenizer: str | Path | None,
        emulate_peers: int = 0,
    ) -> None:
        par, link_spec, device = check_settings(args, cfg, overlap, emulate_peers)  # refusals
        args = _settled_dtype(args, device, model)
        self.args, self.config, self.seed = args, cfg, args.seed
        named = tokenizer is not None  # a directory the caller named must hold one
        self._load_tokenizer(tokenizer or args.tokenizer_dir(), args.chat_template, named)
        spec = engine_spec(args, cfg, model, overlap, par, device, emulate_peers)
        self.spec, self.parallel, self.max_len = spec, par, spec.max_len
        self.executor = start_executor(spec, link_spec, float(args.timeout))
        self.eplb = OnlineEplb.of(args, self.executor, spec.placement)  # --enable-eplb
        self.scheduler = Scheduler(  # one queue per attention-DP group, as many slots as its cache
            self.executor.num_dp,
            spec.num_slots,
            spec.max_len,
            args.max_num_batched_tokens,
            cfg.eos_token_id,
            args.load_balance_method,
            PrefillWaves.of(
                args.enable_pdmux, cfg, args.pdmux_prefill_splits, args.max_num_batched_tokens
            ),
            spec.pool_pages,
            spec.page_size,
            spec.prefix_caching,
            Speculation.of(args.speculative()),
            spec.state_snapshots if cfg.is_hybrid else None,
            spec.window_budget,
        )
        self.last_reply: StepReply | None = None  # the last step's (overlap modes run)

    def _load_tokenizer(self, path: str | Path | None, chat_template: str | None, named=False):
        cfg = self.config
        self.tokenizer = load_tokenizer(path, cfg.vocab_size, named)
        if chat_template is not None:
            with_chat_template(self.tokenizer, chat_template)
        self.constraints = Constraints(self.tokenizer, cfg.vocab_size, cfg.eos_token_id)

    def generate(
        self,
        prompts: str | dict[str, Any] | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        return_logits: bool = False,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, a list of token ids, or vLLM's prompt dict; a
        string or a dict alone is one prompt); outputs come back in prompt order, with their
        text when the model has a tokenizer.

        All prompts are checked before anything runs: a bad one raises InvalidRequestError
        naming it. A call that fails or is interrupted (Ctrl-C) drops its requests, so the
        engine is left as it was before the call.
        """
        prompts = [prompts] if isinstance(prompts, str | dict) else prompts  # one prompt
        if isinstance(prompts, bytes) or not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts must be a list of prompts (text or token ids)")
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if not isinstance(params, Sequence):  # a generator: no length to match the prompts'
            raise InvalidRequestError("params must be SamplingParams or a list, one per prompt")
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if not self.executor.is_driver:  # a torchrun rank > 0
            self.executor.serve()
            return []
        try:
            asked = [
                [self.make_request(f"prompt {i}", p, c, return_logits) for c in candidates(sp)]
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            ]
            outs = iter(self._run([req for group in asked for req in group], progress))
            groups = zip(params, asked, strict=True)
            return [_pick(sp, [next(outs) for _ in group]) for sp, group in groups]
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

    def step(self, record: bool = False) -> list[Request]:
        """Run one forward of every running request; return those that got a token (the
        finished ones have ``finish_reason`` set and have left the scheduler)."""
        step = self.scheduler.schedule()
        request = StepRequest(
            step.batches,
            step.samples(self.constraints.allowed),
            record=record,
            prefill=step.prefill,
            pages=step.pages,
        )
        self.last_reply = self.executor.step(request)
        self.scheduler.update(step, self.last_reply)
        if self.eplb is not None and self.eplb.after_step():  # experts moved at the boundary
            self.spec = dataclasses.replace(self.spec, placement=self.eplb.placement)
        return step.sampled  # a prefill wave's requests get their first token with its last range

    def make_request(
        self, where: str, prompt: Prompt, params: SamplingParams, return_logits=False
    ) -> Request:
        """A checked request, not yet scheduled; InvalidRequestError names ``where`` if bad."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{where}: params must be SamplingParams, not {params!r}")
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError(
                f"{where}: stop strings need a model with a tokenizer", "stop"
            )
        if isinstance(prompt, dict) and [*prompt] in (["prompt"], ["prompt_token_ids"]):
            (prompt,) = prompt.values()  # vLLM's TextPrompt or TokensPrompt
        if isinstance(prompt, str) and self.tokenizer is not None:
            prompt = self.tokenizer.encode(prompt)  # its BOS too, as vLLM's LLM encodes it
        ids = prompt_ids(where, prompt, self.config.vocab_size, self.max_len)
        request_id = next(self._ids)  # atomic: two server threads never share an id
        seed = params.seed if params.seed is not None else self.seed + request_id - 1
        stops = params.stop if isinstance(params.stop, list) else []  # a list once checked
        text = TextStream(self.tokenizer, stops) if self.tokenizer is not None else None
        try:
            params.check_vocabulary(self.config.vocab_size)  # stop_token_ids, logit_bias
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{where}: {exc}", exc.field) from None
        so = params.structured_outputs
        return Request(
            request_id,
            ids,
            params,
            return_logits,
            seed=seed,
            text=text,
            eos_token_id=self.config.eos_token_id,
            constraint=self.constraints.matcher(so, where) if so is not None else None,
        )

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pick(params: SamplingParams, outs: list[RequestOutput]) -> RequestOutput:
    """A prompt's output: its one request's, or with n > 1 the first of the n it returns."""
    if len(outs) == 1:
        return outs[0]
    picked = [outs[k] for k in chosen(params, [o.cumulative_logprob for o in outs])]
    if params.logprobs is None:  # asked only to rank the candidates
        for out in picked:
            out.logprobs = out.cumulative_logprob = None
    return dataclasses.replace(picked[0], outputs=picked)


def _refuse_knobs_beside(settings: dict[str, Any]) -> None:
    """``LLM(overlap=OverlapConfig(...), moe_dispatch_dtype=...)``: the config holds every
    overlap setting, so one given beside it would be ignored; refuse it, naming the fix."""
    clash = sorted(overlap_knobs() & set(EngineArgs.resolve(settings)))
    if clash:
        raise ConfigError(
            f"overlap=OverlapConfig(...) holds every overlap setting, so {', '.join(clash)} "
            "beside it would be ignored: set them in the config "
            f"(dataclasses.replace(config, {clash[0]}=...)), or give overlap as a mode name"
        )
