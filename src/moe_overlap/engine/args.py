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
from typing import Any, cast

from moe_overlap.core.device import DEVICE_HELP, DEVICES, DTYPE_HELP, DTYPES
from moe_overlap.core.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from moe_overlap.core.eplb_placement import ALGORITHMS, Algorithm, PlacementShape
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.expert_location import (
    DISPATCH_ALGORITHMS,
    TRIVIAL,
    ExpertPlacement,
    make_placement,
)
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.overlap_config import OverlapConfig
from moe_overlap.core.parallel_config import ParallelConfig
from moe_overlap.engine.hub_cache import resolve_model
from moe_overlap.engine.load_balance import DEFAULT_LOAD_BALANCE_METHOD, LOAD_BALANCE_METHODS
from moe_overlap.engine.pdmux import DEFAULT_PREFILL_SPLITS

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
    dtype: str = setting("float32", DTYPE_HELP, choices=tuple(DTYPES), group="device")
    cuda_graph_max_bs: int = setting(
        64,
        "on CUDA, decode batches of up to this many sequences per rank replay from CUDA graphs "
        "(one per batch-size, key-length and overlap bucket, captured when first met; with "
        "no overlap, TBO or DBO, and SBO too over the low-latency dispatch); a step that "
        "communicates is graphed only over the low-latency dispatch (--a2a-mode), never under "
        "auto, --tp/--pp > 1, PD-mux or with linear attention, where decode runs eagerly",
        group="device",
    )
    disable_cuda_graph: bool = setting(
        False, "decode eagerly, without CUDA graphs (there are none on CPU)", group="device"
    )
    link: str = setting(
        "none",
        "how ranks talk: none (loopback), netns:RATE (each rank in a network namespace, links "
        "shaped by tc tbf, e.g. netns:2gbit; needs root), or model:BANDWIDTH,LATENCY (a "
        "modelled delay, e.g. model:2gbit,50us)",
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
class EplbArgs:
    """SGLang's EPLB flags: redundant experts and where each expert's replicas live."""

    ep_num_redundant_experts: int = setting(
        0,
        "EPLB: extra physical expert slots, E + R over the --ep ranks, each a replica of a "
        "logical expert (which ones: --init-expert-location)",
        group="eplb",
    )
    init_expert_location: str = setting(
        TRIVIAL,
        "EPLB: trivial (slot i holds expert i % E), a placement JSON "
        '({"physical_to_logical": [[expert per slot] per MoE layer]}, e.g. from '
        "`moe-overlap eplb-placement`), or a distribution JSON "
        '({"load": [[tokens per expert] per MoE layer]}) placed at start-up',
        metavar="trivial|FILE",
        group="eplb",
    )
    ep_dispatch_algorithm: str = setting(
        "static",
        "EPLB: which replica serves a token: static (the one nearest the sending rank) or "
        "dynamic (spread over the replicas, by token)",
        choices=DISPATCH_ALGORITHMS,
        group="eplb",
    )
    eplb_algorithm: str = setting(
        "auto",
        "EPLB: the placement policy for a distribution given to --init-expert-location: "
        "deepseek (global), deepseek_hierarchical (expert groups first), or auto",
        choices=ALGORITHMS,
        group="eplb",
    )

    expert_skew: str | None = setting(
        None,
        "bias the routers so a few experts are hot, to show imbalance (random-weight routers "
        "route almost evenly): zipf:S gives the expert of rank r in each layer odds falling "
        "as 1/(r+1)**S (e.g. zipf:1.2)",
        metavar="zipf:S",
        group="eplb",
    )

    def skew_exponent(self) -> float:
        """``--expert-skew``'s S (0.0: none)."""
        text = self.expert_skew
        if text is None:
            return 0.0
        kind, _, value = str(text).partition(":")
        try:
            exponent = float(value)
        except ValueError:
            exponent = -1.0
        if kind != "zipf" or not exponent >= 0 or exponent == float("inf"):
            raise ConfigError(f"--expert-skew={text!r}: want zipf:S with S >= 0, e.g. zipf:1.2")
        return exponent

    def expert_placement(self, cfg: ModelConfig, ep: int) -> ExpertPlacement | None:
        """The placement these flags ask for over ``ep`` ranks (None: E/ep experts each)."""
        redundant = self.ep_num_redundant_experts
        if not is_int(redundant) or redundant < 0:
            raise ConfigError(f"--ep-num-redundant-experts={redundant!r} must be an integer >= 0")
        if cfg.is_gpt_oss and (redundant or self.init_expert_location != TRIVIAL):
            raise ConfigError(
                "EPLB does not yet place GPT-OSS's fused expert tensors; drop "
                "--ep-num-redundant-experts and --init-expert-location"
            )
        groups = cfg.n_group if cfg.n_group > 1 else None
        shape = PlacementShape(cfg.num_experts, cfg.num_experts + redundant, ep, 1, groups)
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        algorithm = cast(Algorithm, self.eplb_algorithm)
        location, dispatch = self.init_expert_location, self.ep_dispatch_algorithm
        return make_placement(moe_layers, shape, location, dispatch, algorithm)


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
