"""``OverlapArgs``: the overlap scheme and its knobs as engine settings, under the reference
systems' flag names (SGLang's ``--enable-two-batch-overlap`` and the rest, vLLM's
``--enable-dbo``, ours ``--overlap``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_overlap.core.a2a_mode import (
    A2A_MODES,
    DEEPEP_BACKENDS,
    DISPATCH_DTYPES,
    VLLM_BACKENDS,
    parse_a2a_mode,
    resolve_deepep,
)
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import (
    A2A_BACKENDS,
    AUTO_MODES,
    DECODE_ORDERS,
    MODE_MISMATCH,
    SPLIT_POLICIES,
    OverlapConfig,
)
from moe_overlap.core.overlap_modes import MODES, NONE
from moe_overlap.engine.args import DEFAULT_PREFILL_SPLITS, overlap_setting, parse_modes, setting


@dataclass
class OverlapArgs:
    moe_a2a_backend: str = overlap_setting(
        "moe_a2a_backend",
        "token dispatcher: torch (all-to-all over the EP ranks; needs --ep equal to the world), "
        "none (SGLang's tensor-parallel MoE: gather the tokens, run the local experts' slices, "
        "all-reduce), local (one process holds every expert), or auto (local where a pipeline "
        "stage is one rank, "
        "torch when every rank owns whole experts, else none); SGLang's deepep, and "
        "deepep_normal / deepep_low_latency (the layout too, as --a2a-mode), name torch",
        choices=(*A2A_BACKENDS, *DEEPEP_BACKENDS),
        parse=str,
    )
    a2a_mode: str = overlap_setting(
        "a2a_mode",
        "the all-to-all's layout: normal sizes each transfer from the counts it reads back "
        "(any batch); low_latency sends fixed-capacity blocks the host never sizes, so the step "
        "reads nothing back and decode can replay from a CUDA graph, for micro-batches of at "
        "most --num-max-dispatch-tokens-per-rank tokens (a larger one is refused, never cut); "
        "auto: low_latency for decode steps on CUDA, normal for prefill and on CPU (over gloo "
        "the blocks cross whole, padding included). SGLang's --deepep-mode and "
        f"vLLM's --all2all-backend {'|'.join(VLLM_BACKENDS)} name it too; the layout is "
        "DeepEP's, the data path ours, over torch collectives, not the DeepEP library (which "
        "moves the whole blocks, padding included)",
        choices=A2A_MODES,
        parse=parse_a2a_mode,
        aliases=("--deepep-mode", "--all2all-backend"),
    )
    num_max_dispatch_tokens_per_rank: int = overlap_setting(
        "num_max_dispatch_tokens_per_rank",
        "the low-latency dispatch's capacity: tokens one rank may send per micro-batch (each "
        "block holds this many rows per expert; SGLang's default)",
    )
    moe_dispatch_dtype: str = overlap_setting(
        "moe_dispatch_dtype",
        "what the dispatch's rows travel as: auto, the run dtype (--dtype); fp8, "
        "float8_e4m3fn with one float32 scale per token and group of min(128, hidden) columns "
        "(scale = amax / 448, the per-token-group quantization SGLang, vLLM and DeepEP send), "
        "about half of bf16's bytes. The experts get the rows dequantized (on CPU; no FP8 "
        "GEMM), the combine stays in the run dtype, and one process quantizes at the same "
        "point, so every layout and mode computes the same. Lossy: not the run dtype's logits",
        choices=DISPATCH_DTYPES,
    )
    overlap: str | None = setting(
        None,
        "the scheme by name (the --enable flags name some too): "
        + "; ".join(f"{m.name}: {m.summary}" for m in MODES.values()),
        choices=MODES,
        group="overlap (at most one scheme)",
    )
    auto_modes: tuple[str, ...] = overlap_setting(
        "auto_modes",
        f"with --overlap auto: the modes it chooses among, some of {','.join(AUTO_MODES)} "
        "(tbo2/tbo3 cut where estimated time balances); leaving out none forces overlap "
        "wherever an allowed mode fits",
        parse=parse_modes,
        metavar="MODES",
    )
    log_overlap_decisions: bool = overlap_setting(
        "log_overlap_decisions",
        "with --overlap auto: print each forward's choice and the predicted times",
    )
    enable_two_batch_overlap: bool = overlap_setting(
        None,
        "SGLang TBO: split each batch into micro-batches whose computation and all-to-all "
        "interleave layer by layer",
    )
    tbo_token_distribution_threshold: float = overlap_setting(
        "tbo_token_distribution_threshold",
        "two-chunk overlap: cut a sequence in two when the balanced split puts less than this "
        "share of tokens in one micro-batch (0 disables; <= 0.5)",
    )
    num_micro_batches: int = overlap_setting(
        "num_micro_batches", "micro-batches for TBO (more cut tokens evenly)"
    )
    enable_single_batch_overlap: bool = overlap_setting(
        None,
        "SGLang SBO: inside each MoE layer, send finished experts' outputs while the rest "
        "compute, and run shared experts during the dispatch",
    )
    tbo_min_tokens: int = overlap_setting(
        "tbo_min_tokens",
        "TBO runs only when every busy rank has at least this many tokens this step; raise it "
        "where small batches lose to the split's overhead",
    )
    tbo_split_policy: str = overlap_setting(
        "tbo_split_policy",
        "where two-chunk cuts: tokens halves the tokens (SGLang); time balances estimated time "
        "(a later chunk also attends over the earlier one)",
        choices=SPLIT_POLICIES,
    )
    tbo_mode_mismatch: str = overlap_setting(
        "tbo_mode_mismatch",
        "when busy ranks run different forward modes (one prefills, one decodes): off runs "
        "that step without TBO (SGLang); prefill runs the prefill strategy on every rank (ours)",
        choices=MODE_MISMATCH,
    )
    tbo_decode_order: str = overlap_setting(
        "tbo_decode_order",
        "TBO's decode stages: staggered is SGLang's (five stages a layer, the second "
        "micro-batch two behind); lockstep (ours) runs both micro-batches stage by stage in "
        "prefill's cut, so each dispatch and combine travels while the other micro-batch "
        "computes (staggered leaves two transfers a layer exposed where no shared experts fill "
        "the gap)",
        choices=DECODE_ORDERS,
    )
    sbo_combine_blocks: int = overlap_setting(
        "sbo_combine_blocks",
        "SBO: local experts are run in this many blocks (at most one per expert), cut where the "
        "rows that cross ranks balance, each block's outputs sent back while the next computes",
    )
    sbo_comm_sms: int = overlap_setting(
        "sbo_comm_sms", "SBO on CUDA: SMs reserved for communication (recorded; CPU ignores it)"
    )
    enable_dbo: bool = overlap_setting(
        None,
        "vLLM DBO: two micro-batches on two threads handing a baton at each dispatch and combine",
    )
    dbo_decode_token_threshold: int = overlap_setting(
        "dbo_decode_token_threshold", "DBO runs on decode batches of at least this many tokens"
    )
    dbo_prefill_token_threshold: int = overlap_setting(
        "dbo_prefill_token_threshold", "DBO runs on prefill batches of at least this many tokens"
    )
    enable_pdmux: bool = overlap_setting(
        None,
        "PD multiplexing (SGLang): prompts are prefilled whole, a range of layers per step, on "
        "a lane of their own beside the decode batch, so long prompts do not stall running "
        "decodes; not with --pp, tbo, dbo or auto, and needs attention TP 1",
    )
    pdmux_prefill_splits: int = setting(
        DEFAULT_PREFILL_SPLITS,
        "with --enable-pdmux: layer ranges a prefill is cut into, one per step",
        group="overlap (at most one scheme)",
    )

    def overlap_config(self) -> OverlapConfig:
        """The one scheme chosen by ``--overlap`` or an ``--enable-*`` flag, with its knobs."""
        chosen = [
            m.name for m in MODES.values() if m.enable_field and getattr(self, m.enable_field)
        ]
        if self.overlap is not None and self.overlap not in (NONE.name, *chosen):
            chosen.append(self.overlap)
        if len(chosen) > 1:
            raise ConfigError(
                f"overlap schemes {' and '.join(chosen)} are mutually exclusive; enable at most one"
            )
        knobs = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(OverlapConfig)
            if f.name != "mode"
        }
        knobs["moe_a2a_backend"], knobs["a2a_mode"] = resolve_deepep(  # LLM(...) too
            self.moe_a2a_backend, parse_a2a_mode(self.a2a_mode)
        )
        return OverlapConfig(mode=chosen[0] if chosen else NONE.name, **knobs)
