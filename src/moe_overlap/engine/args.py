"""Every engine setting once: its name, type, default, help, choices and the other engines'
spellings. The command line's flags are generated from these fields (``tools/flags.py``) and
``LLM(**kwargs)`` takes the same names, so a default is written here and nowhere else.

A field's metadata: ``help``; ``aliases`` (SGLang's and vLLM's spellings of the flag);
``negations`` (spellings that turn an on-by-default setting off, as ``--disable-radix-cache``);
``choices``; ``parse`` (the argparse type where the default's type does not say it);
``group`` (the help section); ``metavar``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_overlap.core.attention_plan import ATTENTION_BACKENDS
from moe_overlap.core.device import AUTO_DTYPE, DEVICE_HELP, DEVICES, DTYPE_CHOICES, DTYPE_HELP
from moe_overlap.core.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.hub_cache import resolve_model
from moe_overlap.engine.load_balance import DEFAULT_LOAD_BALANCE_METHOD, LOAD_BALANCE_METHODS
from moe_overlap.engine.pdmux import DEFAULT_PREFILL_SPLITS
from moe_overlap.model.quant_config import QUANTIZATIONS

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_SEQS", "DEFAULT_PREFILL_SPLITS"]
_OVERLAP = OverlapConfig()  # the overlap knobs' defaults live on OverlapConfig
LOAD_FORMATS = ("auto", "dummy")


def setting(default: Any, help: str, **meta: Any) -> Any:
    """A settings field: ``default`` and ``help``, with the metadata described above."""
    return field(default=default, metadata={"help": help, **meta})


def parse_modes(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def overlap_setting(name: str | None, help: str, **meta: Any) -> Any:
    """An overlap knob whose default is ``OverlapConfig``'s field ``name``; None: an off flag."""
    default = getattr(_OVERLAP, name) if name else False
    return setting(default, help, group="overlap (at most one scheme)", **meta)


@dataclass
class ModelArgs:
    """Where the weights come from."""

    model: str | None = setting(
        None,
        "checkpoint directory (config.json and *.safetensors in the Hub layout), or a Hub id "
        "(Qwen/Qwen3-30B-A3B) found in the local Hugging Face cache (nothing is downloaded)",
        aliases=("--model-path",),
        metavar="DIR|HUB_ID",
        group="model",
    )
    hf_config: str | None = setting(
        None,
        "a Hugging Face config.json; the weights are seeded random (see --seed)",
        metavar="JSON",
        group="model",
    )
    load_format: str = setting(
        "auto",
        "auto loads the weights; dummy builds seeded random weights from --model's config.json "
        "(or --model naming a config.json), as SGLang's and vLLM's --load-format dummy",
        choices=LOAD_FORMATS,
        group="model",
    )
    seed: int = setting(
        0,
        "seed for random weights and for sampling",
        aliases=("--random-seed",),
        group="model",
    )
    quantization: str | None = setting(
        None,
        "fp8: the checkpoint's weights are FP8 (implied by its quantization_config, so only "
        "a check; a checkpoint without one is refused: there is no online quantization)",
        aliases=("-q",),
        choices=QUANTIZATIONS,
        group="model",
    )
    fp8_dequant_on_the_fly: bool = setting(
        False,
        "keep an FP8 checkpoint's weights resident in FP8 and dequantize them at each use: on "
        "CPU for memory (the default dequantizes them once at load, as CPU has no FP8 matmul; "
        "the logits are the same bit for bit), on a GPU instead of the W8A8 GEMM (docs/fp8.md)",
        group="model",
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template in place of the tokenizer's: a file, or the template itself",
        metavar="TEMPLATE",
        group="model",
    )
    trust_remote_code: bool = setting(
        False,
        "accepted, as vLLM and SGLang take it; no code from a checkpoint ever runs here (every "
        "model family is this package's own)",
        group="model",
    )

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"--load-format={self.load_format!r} must be one of {', '.join(LOAD_FORMATS)}"
            )

    def model_source(self) -> tuple[str | None, str | None]:
        """(checkpoint directory, config.json for random weights): exactly one is set."""
        if (self.model is None) == (self.hf_config is None):
            raise ConfigError(
                "give a model: --model DIR (a checkpoint) or --hf-config JSON (random weights)"
            )
        model = None if self.model is None else resolve_model(self.model)
        if self.load_format == "dummy" and model is not None:
            if not model.endswith(".json"):
                model = model.rstrip("/") + "/config.json"
            return None, model
        return model, self.hf_config

    def tokenizer_dir(self) -> str | None:
        """The directory whose tokenizer the engine loads: --model's, with its weights or, under
        --load-format dummy, without them (as SGLang and vLLM load dummy's tokenizer)."""
        if self.model is None:
            return None
        model = resolve_model(self.model)
        return None if model.endswith(".json") else model


@dataclass
class LayoutArgs:
    """SGLang's layout flags, with SGLang's meanings."""

    tp: int = setting(
        1,
        "tensor-parallel ranks of one replica, started on this machine. Attention, dense MLPs "
        "and the vocabulary split over tp/dp ranks",
        aliases=("--tp-size", "--tensor-parallel-size", "-tp"),
        group="layout",
    )
    dp: int = setting(
        1,
        "data parallelism: with --enable-dp-attention, attention-DP groups inside --tp, each "
        "with its own requests and KV cache, sharing the MoE; without it, independent replicas "
        "of the whole layout (world = dp x tp)",
        aliases=("--dp-size", "--data-parallel-size", "-dp"),
        group="layout",
    )
    enable_dp_attention: bool = setting(
        False, "run attention data parallel: --dp groups of --tp/--dp ranks each", group="layout"
    )
    enable_expert_parallel: bool = setting(
        False,
        "vLLM's: the experts split whole over the --tp ranks (the same as --ep equal to --tp)",
        group="layout",
    )
    ep: int = setting(
        1,
        "expert-parallel size: routed experts split --ep ways inside --tp (ep < tp: each "
        "expert's width split tp/ep ways too); with --tp 1, --ep N is pure expert parallelism "
        "over N ranks",
        aliases=("--ep-size", "--expert-parallel-size"),
        group="layout",
    )
    pp: int = setting(
        1,
        "pipeline stages: contiguous layer ranges (the embedding on the first, the norm and LM "
        "head on the last), each stage --tp ranks; world = dp x pp x tp",
        aliases=("--pp-size", "--pipeline-parallel-size", "-pp"),
        group="layout",
    )
    load_balance_method: str = setting(
        DEFAULT_LOAD_BALANCE_METHOD,
        "which data-parallel group (replica or attention-DP group) a new request joins: "
        "round_robin (in turn; SGLang's default), shortest_queue (fewest requests), "
        "minimum_tokens (fewest tokens left to compute) or cache_aware (the group with most of "
        "the prompt in its prefix cache, as SGLang's router; fewest requests when none has any "
        "or the groups' request counts differ by more than 32)",
        choices=LOAD_BALANCE_METHODS,
        group="layout",
    )
    device: str = setting("cpu", DEVICE_HELP, choices=DEVICES, group="device")
    dtype: str = setting(AUTO_DTYPE, DTYPE_HELP, choices=DTYPE_CHOICES, group="device")
    cuda_graph_max_bs: int = setting(
        64,
        "on CUDA, decode batches of up to this many sequences per rank replay from CUDA graphs "
        "(one per batch-size, key-length and overlap bucket, captured when first met; "
        "speculative verify steps per drafts-per-sequence too, and the MTP drafter's "
        "steps on one rank; with "
        "no overlap, TBO or DBO, and SBO too over the low-latency dispatch); a step that "
        "communicates is graphed only over the low-latency dispatch (--a2a-mode), never under "
        "auto, --tp/--pp > 1, PD-mux or with linear attention, where decode runs eagerly",
        group="device",
    )
    disable_cuda_graph: bool = setting(
        False, "decode eagerly, without CUDA graphs (there are none on CPU)", group="device"
    )
    attention_backend: str = setting(
        ATTENTION_BACKENDS[0],
        "how decode attention reads the paged KV cache: torch_native gathers each sequence's "
        "keys into a contiguous tensor, then runs SDPA; flex_attention reads the pages where "
        "they lie (FlexAttention over the pool, compiled on a GPU, with a block mask of each "
        "sequence's pages; not yet run on a GPU; on CPU one SDPA over the pool with the "
        "kernel's mask, slower: a check of exactness). Sliding-window layers, sinks and MLA "
        "read as torch_native",
        choices=ATTENTION_BACKENDS,
        group="device",
    )
    link: str = setting(
        "none",
        "how ranks talk: none (loopback), netns:RATE (each rank in a network namespace, links "
        "shaped by tc tbf, e.g. netns:2gbit; needs root), or model:BANDWIDTH,LATENCY[,WAIT] (a "
        "modelled delay, e.g. model:2gbit,50us; on a GPU WAIT says how the communication stream "
        "is held: host, the default, a sleeping host function with 0.3-0.5 ms of wake-up per "
        "transfer; globaltimer, a one-warp kernel spinning on the GPU clock; or sleep)",
        metavar="SPEC",
        group="device",
    )
    timeout: float = setting(
        60.0,
        "seconds any collective may wait before the engine stops",
        metavar="S",
        group="device",
    )

    def layout_kwargs(self) -> dict[str, Any]:
        names = ("tp", "dp", "ep", "enable_dp_attention", "pp")
        kwargs = {name: getattr(self, name) for name in names}
        if self.enable_expert_parallel:
            if self.ep not in (1, self.tp):
                raise ConfigError(
                    f"--enable-expert-parallel sets --ep to --tp ({self.tp}), but --ep is "
                    f"{self.ep}; drop one"
                )
            kwargs["ep"] = self.tp
        return kwargs

    def parallel_config(self) -> ParallelConfig:
        """The layout these flags ask for (``ParallelConfig`` checks its own sizes)."""
        return ParallelConfig(**self.layout_kwargs())


@dataclass
class BenchArgs:
    """Settings of ``moe-overlap bench`` alone (no serving command takes them)."""

    emulate_peers: int = setting(
        0,
        "measure overlap on one device (two NCCL ranks cannot share a GPU): this one process "
        "plays rank 0 of --ep N, with its E/N experts and its own tokens through the unchanged "
        "model, overlap schemes and all-to-all dispatcher; each all-to-all is a device copy "
        "plus the --link model's time for the rows that would cross to the N-1 emulated "
        "peers, which by symmetry send back as many. Needs --ep 1; logits mean nothing; 0: off",
        metavar="N",
        group="bench",
    )
