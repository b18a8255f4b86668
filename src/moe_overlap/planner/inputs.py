"""What a plan is about: the model's config (no weights) and the ranks' layout.

The engine refuses a config whose RoPE it cannot compute (DeepSeek-V3's YaRN scaling). The
planner only needs shapes, so it reads such a config with the scaling set aside and says so;
the engine's own check stays as strict as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from moe_overlap.core.a2a_mode import DispatchDtype
from moe_overlap.core.errors import ConfigError, is_int
from moe_overlap.core.hf_config import read_json
from moe_overlap.core.hf_families import rope_kind
from moe_overlap.core.layout_rules import check_layout
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.parallel_config import ParallelConfig


@dataclass(frozen=True)
class ModelSpec:
    cfg: ModelConfig
    name: str
    fp8_weights: bool  # quantization_config says FP8: weights are 1 byte, GEMMs at FP8 rate
    notes: tuple[str, ...] = ()
    fp8_dispatch: bool = False  # --moe-dispatch-dtype fp8: FP8 rows and per-128 scales

    @property
    def weight_bytes(self) -> int:
        return 1 if self.fp8_weights else 2

    def dispatch_bytes(self, activation_bytes: float) -> float:
        """Bytes per element of a dispatched row: FP8's 1 and a float32 scale per 128
        columns, or the run dtype's ``activation_bytes`` (the combine's, always)."""
        if not self.fp8_dispatch:
            return activation_bytes
        h = self.cfg.hidden_size
        return 1 + 4 * math.ceil(h / 128) / h

    def precision(self, activation_bytes: int = 2) -> str:
        """What a plan's title says of it: the weights', the dispatch's and the combine's
        dtypes; ``activation_bytes``: the cluster's run dtype (4 on ``this``: the engine's
        float32 on CPU)."""
        run = "FP32" if activation_bytes == 4 else "BF16"
        weights, dispatch = ("FP8" if f else run for f in (self.fp8_weights, self.fp8_dispatch))
        return f"{weights} weights, {dispatch} dispatch, {run} combine"


def with_precision(spec: ModelSpec, quantization: str | None, dispatch_dtype: str) -> ModelSpec:
    """``spec`` under ``--quantization fp8`` (FP8 weights, whatever the checkpoint says; None:
    as the checkpoint says) and ``--moe-dispatch-dtype``."""
    return replace(
        spec,
        fp8_weights=spec.fp8_weights or quantization == "fp8",
        fp8_dispatch=dispatch_dtype == DispatchDtype.FP8,
    )


def load_model_spec(path: str | Path) -> ModelSpec:
    """A Hugging Face ``config.json`` (or a directory holding one) as plan input."""
    raw = read_json(path)
    notes = []
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
    kind = rope_kind(scaling) if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        raw = {k: v for k, v in raw.items() if k != "rope_scaling"}
        if "rope_parameters" in raw:
            raw["rope_parameters"] = {"rope_type": "default"}
        notes.append(f"rope scaling {kind!r} set aside: it changes no FLOPs or bytes")
    quant = raw.get("quantization_config") or {}
    fp8 = isinstance(quant, dict) and (
        quant.get("quant_method") == "fp8" or str(quant.get("fmt", "")).startswith("e4m3")
    )
    cfg = ModelConfig.from_hf(raw)
    stem = Path(path).stem if Path(path).suffix == ".json" else Path(path).name
    return ModelSpec(cfg, stem, fp8, tuple(notes))


@dataclass(frozen=True)
class PlanLayout:
    """SGLang's arithmetic: ``world = tp`` GPUs; DP attention gives each of ``dp`` groups its
    own requests with ``attn_tp = tp // dp`` GPUs per attention group; experts over ``ep``.
    Without DP attention every GPU sees the whole batch and attention heads split ``tp`` ways.
    ``redundant``: EPLB's extra expert slots, so each GPU holds ``(experts + redundant) / ep``.
    """

    world: int
    ep: int
    attn_tp: int
    redundant: int = 0

    def slots_per_gpu(self, cfg: ModelConfig) -> int:
        """Expert slots each EP rank holds (the replicas of EPLB's redundant experts too)."""
        return (cfg.num_experts + self.redundant) // self.ep

    @property
    def dp_groups(self) -> int:
        return self.world // self.attn_tp

    def group_of(self, rank: int) -> int:
        return rank // self.attn_tp


def make_layout(
    tp: int | None,
    dp: int | None,
    ep: int,
    dp_attention: bool,
    cfg: ModelConfig | None = None,
    redundant: int = 0,
) -> PlanLayout:
    """``--ep`` alone (the engine's own layout): ``ep`` ranks, each with its own batch. Legal
    layouts are the engine's (``core/layout_rules.py``, and ``cfg`` with ``redundant`` extra
    slots must fit: ``ep`` divides the experts and slots together, not the experts alone); the
    planner models those with whole experts per GPU (``--ep`` 1 or ``--tp``) and one replica."""
    if not is_int(redundant) or redundant < 0:
        raise ConfigError(f"--ep-num-redundant-experts={redundant!r} must be an integer >= 0")
    if tp is None:
        par = ParallelConfig(ep=ep, dp=1 if dp is None else dp)
    else:
        dp = dp if dp is not None else tp if dp_attention else 1
        par = ParallelConfig(tp=tp, dp=dp, ep=ep, enable_dp_attention=dp_attention)
    check_layout(par, cfg, redundant=redundant)
    if par.replicas > 1:
        raise ConfigError(
            f"--dp={par.dp} without --enable-dp-attention runs {par.dp} independent replicas; "
            "plan one (drop --dp), or add --enable-dp-attention"
        )
    if not par.pure_ep and ep not in (1, par.tp):
        raise ConfigError(
            f"--ep={ep} with --tp={par.tp}: the planner models whole experts per GPU; set --ep "
            f"to 1 or {par.tp}"
        )
    return PlanLayout(par.stage_size, ep, par.attn_tp, redundant)
