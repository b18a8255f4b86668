"""``EngineArgs`` to ``EngineSpec``: the one place the engine's settings become what every
rank is started with."""

from __future__ import annotations

from pathlib import Path

from moe_overlap.core.engine_config import EngineSpec
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.engine_args import EngineArgs
from moe_overlap.engine.kv_memory import kv_cache_bytes
from moe_overlap.engine.spec_config import mtp_steps


def engine_spec(
    args: EngineArgs,
    cfg: ModelConfig,
    model: str | Path | None,
    overlap: OverlapConfig,
    par: ParallelConfig,
    device: str,
    emulate_peers: int = 0,
) -> EngineSpec:
    """The spec of checked ``args`` (``check_settings`` gave ``par`` and ``device``), with
    the KV budget and EPLB's placement worked out."""
    speculative = args.speculative()
    drafts = mtp_steps(speculative)
    return EngineSpec(
        cfg,
        str(model) if model is not None else None,
        args.seed,
        args.max_num_seqs,
        cfg.max_len(args.max_model_len),
        overlap,
        kv_cache_bytes(args, cfg, par, device),
        parallel=par,
        device=device,
        dtype=args.dtype,
        cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
        pdmux_splits=args.pdmux_prefill_splits if args.enable_pdmux else 0,
        emulate_peers=emulate_peers,
        page_size=args.page_size,
        attention_backend=args.attention_backend,
        max_total_tokens=args.max_total_tokens,
        placement=args.expert_placement(cfg, par, emulate_peers, mtp=drafts > 0),
        expert_skew=args.skew_exponent(),
        fp8_on_the_fly=args.fp8_dequant_on_the_fly,
        mtp_steps=drafts,
        verify_rows=speculative.num_drafts + 1 if speculative is not None else 0,
        prefix_caching=args.enable_prefix_caching,
        sliding_budget=not (args.enable_pdmux or speculative),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
