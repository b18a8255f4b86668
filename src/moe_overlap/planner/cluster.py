"""The hardware a plan runs on: compute rates, memory bandwidth, the all-to-all link, overheads.

A cluster is plain numbers, read from a preset in ``configs/clusters/``, from any JSON file of
the same shape, or measured on this machine (``calibration.py``). Every rate is what one GPU
(or one rank) sees; the all-to-all rates are DeepEP-style "bottleneck bandwidths": the bytes one
rank sends inside its node over ``intra_node_a2a_gbps`` and across nodes over
``inter_node_a2a_gbps``, both at once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_overlap.core.errors import ConfigError, is_finite_number, is_int

PRESET_DIR = Path(__file__).resolve().parents[3] / "configs" / "clusters"
_POSITIVE = (
    "gemm_tflops_bf16",
    "gemm_tflops_fp8",
    "gemm_efficiency",
    "attention_efficiency",
    "hbm_gbps",
    "hbm_efficiency",
    "intra_node_a2a_gbps",
    "inter_node_a2a_gbps",
    "allreduce_gbps",
    "kv_read_gbps",
    "activation_bytes",
    "a2a_bytes_factor",
)
_NON_NEGATIVE = (
    "a2a_latency_us",
    "op_overhead_us",
    "seq_overhead_us",
    "decode_seq_overhead_us",
    "forward_overhead_us",
    "expert_overhead_us",
    "switch_overhead_us",
    "comm_sm_share",
)


@dataclass(frozen=True)
class Cluster:
    """One cluster's numbers (units in the names; a rate of ``inf`` never limits)."""

    name: str
    nodes: int
    gpus_per_node: int
    gemm_tflops_bf16: float
    gemm_efficiency: float
    attention_efficiency: float
    hbm_gbps: float
    intra_node_a2a_gbps: float
    inter_node_a2a_gbps: float
    a2a_latency_us: float
    gemm_tflops_fp8: float = 0.0  # 0: no FP8 GEMMs; FP8 weights then run at the BF16 rate
    hbm_efficiency: float = 1.0
    allreduce_gbps: float = 0.0  # 0: the intra-node all-to-all rate
    kv_read_gbps: float = 0.0  # 0: the HBM rate (a CPU reads a cache slower than it streams)
    op_overhead_us: float = 0.0  # per operation of one micro-batch (launches, small kernels)
    seq_overhead_us: float = 0.0  # per prefill sequence per attention op (a host loop; decode
    # batches its sequences in one call)
    decode_seq_overhead_us: float = 0.0  # per decode sequence per attention op (on a CPU, small
    # GEMMs and the padded decode path cost more per token than prefill's FLOPs say)
    forward_overhead_us: float = 0.0  # per forward (scheduling, logits back to the driver)
    expert_overhead_us: float = 0.0  # per active local expert per micro-batch (a CPU loops
    # over its experts: each one's calls and weights again for every micro-batch)
    switch_overhead_us: float = 0.0  # DBO: per stage, handing the turn to the other thread
    # the three overheads above are what each micro-batch after the first adds (fitted on this
    # machine from pairs; the first pass's fixed costs are inside its fitted rates)
    overheads_beyond_first: bool = False
    a2a_bytes_factor: float = 1.0  # bytes on a rank's link relative to the routing below (the
    # engine sends max(sent, received) rows off-rank; uneven routing makes that larger)
    expert_shares: tuple[float, ...] = ()  # per EP rank, the share of routed rows its experts
    # get (summing to 1; empty: even). Measured on this machine: the model's router favours
    # some ranks' experts, and which ones decides the bytes of uneven micro-batches
    expert_imbalance: float = 1.0  # per MoE layer, the busiest rank's expert rows over the
    # mean (>= 1): the layer waits for that rank, so every rank's experts are timed at it
    comm_sm_share: float = 0.0  # share of compute lost while an all-to-all is in flight
    activation_bytes: int = 2  # bytes per element sent in an all-to-all
    # a chunk with a prefix computes the whole (new x keys) rectangle (CPU SDPA with a mask)
    attention_full_rectangle_with_prefix: bool = False
    attention_tflops: float = 0.0  # 0: gemm_tflops_bf16 x attention_efficiency
    # DeepEP: a token crosses RDMA once per remote node and NVLink once per GPU it reaches,
    # however many of its top-k experts sit there (the engine's torch backend sends every row)
    a2a_dedup: bool = False
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"cluster {self.name}: {name}={value!r} must be an integer >= 1")
        for name in _POSITIVE:
            value = getattr(self, name)
            if name in ("gemm_tflops_fp8", "allreduce_gbps", "kv_read_gbps") and value == 0:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"cluster {self.name}: {name}={value!r} must be positive")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ConfigError(f"cluster {self.name}: {name}={value!r} must be >= 0")
        if not (is_finite_number(self.expert_imbalance) and self.expert_imbalance >= 1):
            raise ConfigError(
                f"cluster {self.name}: expert_imbalance={self.expert_imbalance!r} must be a "
                "number >= 1 (the busiest rank's expert rows over the mean; 1: even)"
            )
        if self.comm_sm_share >= 1:
            raise ConfigError(f"cluster {self.name}: comm_sm_share must be below 1")
        shares = self.expert_shares
        if not isinstance(shares, list | tuple) or not all(
            is_finite_number(s) and s > 0 for s in shares
        ):
            raise ConfigError(
                f"cluster {self.name}: expert_shares={shares!r} must be a list of positive "
                "numbers, one per EP rank (or empty for even routing)"
            )
        if shares and (len(shares) < 2 or abs(sum(shares) - 1) > 1e-3):
            raise ConfigError(
                f"cluster {self.name}: expert_shares={list(shares)!r} must hold 2 or more "
                f"shares that sum to 1 (they sum to {sum(shares):.4f})"
            )
        object.__setattr__(self, "expert_shares", tuple(float(s) for s in shares))

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def gemm_flops_per_s(self, fp8: bool) -> float:
        peak = self.gemm_tflops_fp8 if fp8 and self.gemm_tflops_fp8 else self.gemm_tflops_bf16
        return peak * 1e12 * self.gemm_efficiency

    @property
    def attention_flops_per_s(self) -> float:
        if self.attention_tflops:
            return self.attention_tflops * 1e12
        return self.gemm_tflops_bf16 * 1e12 * self.attention_efficiency

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9 * self.hbm_efficiency

    @property
    def kv_bytes_per_s(self) -> float:
        return self.kv_read_gbps * 1e9 if self.kv_read_gbps else self.hbm_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cluster_from_dict(raw: dict[str, Any], origin: str) -> Cluster:
    names = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"cluster {origin}: unknown field(s) {', '.join(unknown)}")
    missing = [
        f.name
        for f in dataclasses.fields(Cluster)
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in raw
    ]
    if missing:
        raise ConfigError(f"cluster {origin}: missing field(s) {', '.join(missing)}")
    return Cluster(**raw)


def presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name (``2x8-h800``), or a JSON file of the same fields."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise ConfigError(
            f"--cluster {name_or_path!r}: neither a preset ({', '.join(presets())}, this) "
            "nor a JSON file"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--cluster {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--cluster {path} must hold a JSON object")
    return cluster_from_dict(raw, str(path))
