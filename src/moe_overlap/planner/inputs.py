"""What a plan is about: the model's config (no weights) and the ranks' layout.

The engine refuses a config whose RoPE it cannot compute (DeepSeek-V3's YaRN scaling). The
planner only needs shapes, so it reads such a config with the scaling set aside and says so;
the engine's own check stays as strict as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_overlap.core.errors import ConfigError
from moe_overlap.core.hf_config import read_json
from moe_overlap.core.model_config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    cfg: ModelConfig
    name: str
    fp8_weights: bool  # quantization_config says FP8: weights are 1 byte, GEMMs at FP8 rate
    notes: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        return 1 if self.fp8_weights else 2


def load_model_spec(path: str | Path) -> ModelSpec:
    """A Hugging Face ``config.json`` (or a directory holding one) as plan input."""
    raw = read_json(path)
    notes = []
    scaling = raw.get("rope_scaling") or (raw.get("rope_parameters") or {})
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
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
    """

    world: int
    ep: int
    attn_tp: int

    @property
    def dp_groups(self) -> int:
        return self.world // self.attn_tp

    def group_of(self, rank: int) -> int:
        return rank // self.attn_tp


def make_layout(tp: int | None, dp: int | None, ep: int, dp_attention: bool) -> PlanLayout:
    """``--ep`` alone (the engine's own layout): ``ep`` ranks, each with its own batch."""
    if ep < 1 or (tp is not None and tp < 1) or (dp is not None and dp < 1):
        raise ConfigError("--tp, --dp and --ep must be >= 1")
    if tp is None:
        if dp not in (None, ep):
            raise ConfigError(f"--dp={dp} without --tp: the ranks are --ep={ep}, one batch each")
        return PlanLayout(ep, ep, 1)
    if ep not in (1, tp):
        raise ConfigError(f"--ep={ep} must be 1 or --tp={tp} (experts over every GPU)")
    if dp_attention:
        dp = dp or tp
        if tp % dp:
            raise ConfigError(f"--dp={dp} must divide --tp={tp} with --enable-dp-attention")
        return PlanLayout(tp, ep, tp // dp)
    if dp not in (None, 1):
        raise ConfigError(f"--dp={dp} needs --enable-dp-attention (else every GPU sees all)")
    return PlanLayout(tp, ep, tp)
