"""The hardware a plan runs on: compute rates, memory bandwidth, the all-to-all link, overheads.

A cluster is plain numbers: built for ``<nodes>x<gpus>-<gpu>`` from the per-GPU table in
``gpus.py``, read from any JSON file of the same shape, or measured on this machine
(``calibration.py``). Every rate is what one GPU
(or one rank) sees; the all-to-all rates are DeepEP-style "bottleneck bandwidths": the bytes one
rank sends inside its node over ``intra_node_a2a_gbps`` and across nodes over
``inter_node_a2a_gbps``, both at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from moe_overlap.core.errors import ConfigError, is_finite_number, is_int
from moe_overlap.core.repo_files import CONFIGS
from moe_overlap.planner import gpus

PRESET_DIR = CONFIGS / "clusters"
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
    "host_launch_us",
    "comm_sm_share",
    "ll_comm_sm_share",
    "gemm_half_rows",
    "decode_attention_tflops",
)


class Overheads(TypedDict):
    """A cluster's fixed costs that each micro-batch after the first adds (``Cluster``'s
    fields of the same names), as ``dataclasses.replace`` takes them."""

    op_overhead_us: float
    expert_overhead_us: float
    switch_overhead_us: float


def overheads_us(op_s: float, expert_s: float, switch_s: float) -> Overheads:
    """``Overheads`` from seconds."""
    return Overheads(
        op_overhead_us=op_s * 1e6,
        expert_overhead_us=expert_s * 1e6,
        switch_overhead_us=switch_s * 1e6,
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
    # one host thread launches each device operation in program order; a dispatch's read of the
    # counts drains the device first (0: the host never limits; a CPU's is in its compute)
    host_launch_us: float = 0.0  # host time per launched device operation
    launches_per_op: int = 1  # device operations (kernels) per simulated op
    decode_host_launch_us: float | None = None  # all-decode (CUDA graphs: 0); None: the above
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
    # GPU effects (docs/planner.md, "GPU clusters"); the defaults leave them out
    gemm_row_tile: int = 1  # a GEMM's rows are computed in tiles of this many (Hopper: 64)
    gemm_half_rows: float = 0.0  # GEMM efficiency x m / (m + this) for m rows per GEMM (per
    # expert in grouped GEMMs): small GEMMs reach less of the peak
    decode_attention_tflops: float = 0.0  # decode attention's rate (FlashMLA); 0: prefill's
    decode_op_overhead_us: float | None = None  # per op in decode (CUDA graphs); None: op's
    # DeepEP low-latency kernels for decode micro-batches: per EP size, GB/s of the bytes each
    # rank sends (top-k copies, no dedup); empty: decode uses the normal kernels too
    ll_dispatch_gbps: tuple[tuple[int, float], ...] = ()
    ll_combine_gbps: tuple[tuple[int, float], ...] = ()
    ll_comm_sm_share: float = 0.0  # share of compute lost while a low-latency transfer is out
    # DeepEP normal kernels across nodes: per EP size, the RDMA rate measured with the NVLink
    # forwarding inside the kernel (RDMA was the bottleneck); empty: both links timed
    normal_rdma_gbps: tuple[tuple[int, float], ...] = ()
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
        for name in ("comm_sm_share", "ll_comm_sm_share"):
            if getattr(self, name) >= 1:
                raise ConfigError(f"cluster {self.name}: {name} must be below 1")
        for name, hint in (("gemm_row_tile", " (Hopper: 64)"), ("launches_per_op", "")):
            if not is_int(value := getattr(self, name)) or value < 1:
                raise ConfigError(
                    f"cluster {self.name}: {name}={value!r} must be an integer >= 1{hint}"
                )
        for name in ("decode_op_overhead_us", "decode_host_launch_us"):
            over = getattr(self, name)
            if over is not None and not (is_finite_number(over) and over >= 0):
                raise ConfigError(f"cluster {self.name}: {name}={over!r} must be >= 0")
        for name in ("ll_dispatch_gbps", "ll_combine_gbps", "normal_rdma_gbps"):
            object.__setattr__(self, name, _ep_table(self.name, name, getattr(self, name)))
        if bool(self.ll_dispatch_gbps) != bool(self.ll_combine_gbps):
            raise ConfigError(
                f"cluster {self.name}: give both ll_dispatch_gbps and ll_combine_gbps, or neither"
            )
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

    def host_launch_s(self, decode: bool) -> float:
        """The host's seconds to launch one device operation of a micro-batch."""
        us = self.decode_host_launch_us if decode else None
        return (self.host_launch_us if us is None else us) * 1e-6

    @property
    def low_latency(self) -> bool:
        return bool(self.ll_dispatch_gbps)

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


def _ep_table(cluster: str, name: str, raw: Any) -> tuple[tuple[int, float], ...]:
    """``[[ep, gbps], ...]`` with EP sizes rising and positive rates, as a tuple."""
    try:
        ok = all(is_int(ep) and ep >= 2 and is_finite_number(g) and g > 0 for ep, g in raw)
        rows = tuple((int(ep), float(gbps)) for ep, gbps in raw) if ok else ()
    except (TypeError, ValueError):
        ok, rows = False, ()
    if not ok or [ep for ep, _ in rows] != sorted({ep for ep, _ in rows}):
        raise ConfigError(
            f"cluster {cluster}: {name}={raw!r} must be [[ep, GB/s], ...] with integer EP sizes "
            ">= 2, rising, and positive rates"
        )
    return rows


def ep_rate(table: tuple[tuple[int, float], ...], ep: int) -> float:
    """A rate by EP size from a table: interpolated in log(EP), held flat past its ends."""
    if ep <= table[0][0]:
        return table[0][1]
    for (e0, g0), (e1, g1) in itertools.pairwise(table):
        if ep <= e1:
            w = math.log(ep / e0) / math.log(e1 / e0)
            return g0 + w * (g1 - g0)
    return table[-1][1]


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


EXAMPLES = ("1x8-h100", "2x8-h800", "4x8-h100", "8x8-h100", "2x8-h20", "1x8-h200", "1x8-b200")


def presets() -> list[str]:
    """Example ``<nodes>x<gpus>-<gpu>`` specs (any shape works) and JSON files in PRESET_DIR."""
    return [*EXAMPLES, *sorted(p.stem for p in PRESET_DIR.glob("*.json"))]


def load_cluster(name_or_path: str) -> Cluster:
    """``<nodes>x<gpus>-<gpu>`` (``8x8-h100``, from ``gpus.py``'s table), or a JSON file of
    the same fields (a path, or a name in ``configs/clusters/``)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PRESET_DIR / f"{name_or_path}.json"
    if not path.is_file():
        if gpus.is_spec(name_or_path) or "-" in name_or_path:
            return Cluster(**gpus.cluster_fields(name_or_path))
        raise ConfigError(
            f"--cluster {name_or_path!r}: neither {gpus.FORMS} (GPUs: {', '.join(gpus.GPUS)}), "
            "a cluster JSON file, nor this"
        )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--cluster {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--cluster {path} must hold a JSON object")
    return cluster_from_dict(raw, str(path))
