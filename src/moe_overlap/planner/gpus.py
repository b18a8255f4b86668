"""``<nodes>x<gpus>-<gpu>`` clusters (``8x8-h100``) from one table of per-GPU numbers.

Every number is a datasheet figure or a published kernel benchmark, with its source beside it
in ``sources``; none was set to make a published overlap result come out right (the cases that
``--reproduce`` checks are listed in docs/planner.md with what, if anything, informed each
number). Software effects that do not depend on the GPU (DeepEP's kernel families, DeepGEMM's
efficiency by rows, launch costs) are in ``SOFTWARE`` and scaled per GPU where the hardware sets
them (SM counts, NVLink rates).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from moe_overlap.core.errors import ConfigError


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0: no FP8 tensor cores
    hbm_gbps: float
    nvlink_gbps: float  # one direction (half the datasheet's bidirectional figure)
    sms: int
    nic_gbps: float  # one RDMA NIC per GPU, GB/s (400 Gb/s ConnectX-7: 50)
    source: str


GPUS = {
    g.name: g
    for g in (
        Gpu(
            "h100",
            989,
            1979,
            3350,
            450,
            132,
            50,
            "NVIDIA H100 SXM5 datasheet: 989 TFLOPS "
            "dense BF16, 1979 dense FP8, 3.35 TB/s HBM3, NVLink 900 GB/s (bidirectional), "
            "132 SMs; DGX H100: one 400 Gb/s ConnectX-7 per GPU",
        ),
        Gpu(
            "h800",
            989,
            1979,
            3350,
            200,
            132,
            50,
            "NVIDIA H800 SXM5: H100's compute and "
            "HBM3 3.35 TB/s, NVLink 400 GB/s (bidirectional), 132 SMs; DeepEP's test cluster: "
            "one 400 Gb/s ConnectX-7 per GPU",
        ),
        Gpu(
            "h20",
            148,
            296,
            4000,
            450,
            78,
            50,
            "NVIDIA H20 datasheet: 148 TFLOPS dense "
            "BF16, 296 dense FP8, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s, 78 SMs; 400 Gb/s "
            "NIC per GPU",
        ),
        Gpu(
            "h200",
            989,
            1979,
            4800,
            450,
            132,
            50,
            "NVIDIA H200 SXM datasheet: 989 TFLOPS "
            "dense BF16, 1979 dense FP8, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, 132 SMs; "
            "400 Gb/s ConnectX-7 per GPU",
        ),
        Gpu(
            "b200",
            2250,
            4500,
            8000,
            900,
            148,
            50,
            "NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 "
            "training (sparse) per 8 GPUs, i.e. 4.5 dense FP8 and 2.25 dense BF16 per GPU, "
            "8 TB/s HBM3e, NVLink 5 1.8 TB/s (bidirectional), 148 SMs; 400 Gb/s ConnectX-7 per "
            "GPU",
        ),
    )
}

# DeepEP V1 README (docs/legacy.md), low-latency kernels on H800 + CX7 400 Gb/s, 128 tokens,
# hidden 7168, top-8, FP8 dispatch, BF16 combine: per EP size, RDMA bandwidth in GB/s
# (dispatch 77-194 us, combine 114-369 us from EP8 to EP256)
LL_DISPATCH_GBPS = ((8, 98), (16, 63), (32, 48), (64, 43), (128, 39), (256, 39))
LL_COMBINE_GBPS = ((8, 127), (16, 74), (32, 53), (64, 46), (128, 39), (256, 40))
# DeepEP V1 README, normal kernels across nodes, same shapes at 4096 tokens: the RDMA
# bottleneck bandwidth (dispatch 43/58/51, combine 43/57/50 GB/s at EP16/32/64; the lower)
NORMAL_RDMA_GBPS = ((16, 43), (32, 57), (64, 50))

SOFTWARE = {
    "normal_kernel_sms": 24,  # DeepEP V1 README: Buffer.set_num_sms(24) for normal kernels
    "nvlink_share": 153 / 200,  # DeepEP: 153 GB/s of H800's 200 GB/s one-way NVLink
    "rdma_gbps": 50,  # DeepEP: 43-58 GB/s normal kernels over a 400 Gb/s NIC (~50 max)
    "gemm_efficiency": 0.66,  # DeepGEMM: ~1300 of 1979 FP8 TFLOPS for M=4096 DeepSeek shapes
    "gemm_half_rows": 100,  # DeepGEMM masked grouped GEMMs: 932/1040/1233 TFLOPS at 256/512/
    # 1024 rows per expert, i.e. 0.66 x m / (m + 100)
    "gemm_row_tile": 64,  # Hopper WGMMA: 64 rows per warpgroup tile
    "attention_efficiency": 0.55,  # FlashAttention-3: ~500-600 of 989 TFLOPS, causal, 2k-4k
    "decode_attention_efficiency": 660 / 989,  # FlashMLA: 660 TFLOPS compute-bound on H800
    "kv_read_share": 3000 / 3350,  # FlashMLA: 3000 GB/s memory-bound on H800 (3.35 TB/s)
    "hbm_efficiency": 0.8,  # DeepGEMM memory-bound shapes: ~2.6 of 3.35 TB/s
    "kernels_per_op": 2,  # DeepSeek-V3 decode profile: ~25 kernels per layer, 13 ops here
    "small_kernel_us": 4.5,  # GPU time of a kernel with almost no work (DeepSeek's profile)
    "kernel_launch_us": 5.0,  # the CPU's cost to launch one kernel (eager mode)
}

SOURCES = {
    "intra_node_a2a_gbps": "DeepEP normal kernels: 153 GB/s over H800's 200 GB/s one-way NVLink "
    "(77%), applied to this GPU's one-way NVLink (DeepEP V2 measured 726 GB/s on B200, "
    "this rule gives 689)",
    "inter_node_a2a_gbps": "DeepEP V1 README, normal kernels: 43-58 GB/s RDMA (EP16-64) over "
    "one 400 Gb/s ConnectX-7 per GPU (~50 GB/s maximum); 50 used",
    "ll_dispatch_gbps": "DeepEP V1 README, low-latency kernels, H800 + CX7: dispatch 77-194 us "
    "(98-39 GB/s) from EP8 to EP256 at 128 tokens; time = bytes / the EP size's bandwidth",
    "normal_rdma_gbps": "DeepEP V1 README, normal kernels across nodes (H800, CX7, DeepSeek-V3 "
    "shapes): RDMA is the bottleneck at 43/57/50 GB/s for EP16/32/64, the NVLink forwarding "
    "inside the kernel keeps up; so a multi-node all-to-all is timed by its RDMA bytes",
    "ll_combine_gbps": "DeepEP V1 README, low-latency kernels: combine 114-369 us (127-39 GB/s) "
    "from EP8 to EP256 at 128 tokens",
    "comm_sm_share": "DeepEP normal kernels run on 24 SMs (README: Buffer.set_num_sms(24); the "
    "DeepSeek-V3 report: 20 SMs); compute overlapping them runs on the rest",
    "ll_comm_sm_share": "DeepEP low-latency kernels with a receive hook occupy no SMs while the "
    "data is in flight (V1 README)",
    "gemm_efficiency": "DeepGEMM README (H800, FP8): ~1300 TFLOPS of 1979 on M=4096 DeepSeek-V3 "
    "shapes (0.66); BF16 GEMMs taken at the same share of their peak",
    "gemm_half_rows": "DeepGEMM README, masked grouped GEMMs: 932, 1040 and 1233 TFLOPS at 256, "
    "512 and 1024 rows per expert; 0.66 x m / (m + 100) gives 0.47, 0.55, 0.60 of peak",
    "gemm_row_tile": "Hopper WGMMA tiles are 64 rows: a GEMM of 16 rows computes 64",
    "attention_efficiency": "FlashAttention-3 paper: ~500-600 of 989 BF16 TFLOPS for causal "
    "attention at 2k-4k tokens; FA3-class prefill kernels",
    "decode_attention_tflops": "FlashMLA README: 660 TFLOPS compute-bound decode on H800 "
    "(0.67 of peak), scaled by this GPU's BF16 peak; one fused kernel, so its time is the "
    "larger of compute and KV reads (DeepSeek's decode profile: 255 us for 128 sequences of 4K "
    "context on H800, this rule gives 221)",
    "kv_read_gbps": "FlashMLA README: 3000 GB/s memory-bound decode on H800's 3.35 TB/s (0.9)",
    "hbm_efficiency": "DeepGEMM README memory-bound shapes (M=64-128): ~2.6 TB/s of 3.35",
    "op_overhead_us": "2 kernels per op x 4.5 us: DeepSeek's published decode profile "
    "(deepseek-ai/profile-data, H800; per kernel as tabulated at zdszero.github.io "
    "deepseek_profile) has ~25 kernels per layer (13 ops here) and its small kernels (norms, "
    "quantisation, rotary, top-k, SiLU) take 2-8 us, mean 4.6; eager prefill's CPU launches run "
    "ahead of the GPU",
    "decode_op_overhead_us": "CUDA graphs in decode (SGLang's default) remove the CPU's ~5 us "
    "launch per kernel (cudaLaunchKernel); eager decode pays max(CPU launch, GPU kernel) per "
    "kernel",
    "host_launch_us": "the CPU's ~5 us per kernel launch (cudaLaunchKernel), 2 kernels per op, "
    "from one host thread in program order (eager); CUDA graphs in decode launch one graph per "
    "step (0 per kernel)",
    "a2a_latency_us": "DeepEP normal kernels (prefill) beside their bytes: the CPU waits for "
    "the received counts, then launches the experts with the GPU's queue drained: two launches "
    "(~10 us); the low-latency kernels' times above include theirs",
}

SPEC = re.compile(r"^(\d+)x(\d+)-([a-z0-9]+)$")
FORMS = "<nodes>x<gpus>-<gpu>, e.g. 8x8-h100 or 2x8-h20"


def is_spec(name: str) -> bool:
    return bool(SPEC.match(name.lower()))


def cluster_fields(name: str, graphs: bool = True) -> dict[str, Any]:
    """The ``Cluster`` fields of ``<nodes>x<gpus>-<gpu>`` (``graphs``: decode runs in CUDA
    graphs, as SGLang's does by default)."""
    m = SPEC.match(name.lower())
    if not m:
        raise ConfigError(
            f"--cluster {name!r}: not a cluster spec; use {FORMS} (GPUs: {', '.join(GPUS)}), "
            "a cluster JSON file, or this"
        )
    nodes, per_node, kind = int(m[1]), int(m[2]), m[3]
    if kind not in GPUS:
        raise ConfigError(
            f"--cluster {name!r}: unknown GPU {kind!r}; known: {', '.join(GPUS)} ({FORMS}), or "
            "give a cluster JSON file"
        )
    if nodes < 1 or not 1 <= per_node <= 8:
        raise ConfigError(
            f"--cluster {name!r}: {nodes} nodes of {per_node} GPUs; nodes must be >= 1 and "
            f"GPUs per node 1-8 ({FORMS})"
        )
    g, s = GPUS[kind], SOFTWARE
    launch = s["kernels_per_op"] * s["small_kernel_us"]
    eager = s["kernels_per_op"] * max(s["small_kernel_us"], s["kernel_launch_us"])
    return dict(
        name=f"{nodes}x{per_node}-{kind}",
        description=f"{nodes} node(s) x {per_node} NVIDIA {kind.upper()}",
        nodes=nodes,
        gpus_per_node=per_node,
        gemm_tflops_bf16=g.bf16_tflops,
        gemm_tflops_fp8=g.fp8_tflops,
        gemm_efficiency=s["gemm_efficiency"],
        gemm_half_rows=s["gemm_half_rows"],
        gemm_row_tile=s["gemm_row_tile"],
        attention_efficiency=s["attention_efficiency"],
        decode_attention_tflops=g.bf16_tflops * s["decode_attention_efficiency"],
        hbm_gbps=g.hbm_gbps,
        hbm_efficiency=s["hbm_efficiency"],
        kv_read_gbps=g.hbm_gbps * s["kv_read_share"],
        intra_node_a2a_gbps=g.nvlink_gbps * s["nvlink_share"],
        inter_node_a2a_gbps=min(s["rdma_gbps"], g.nic_gbps),
        allreduce_gbps=g.nvlink_gbps * s["nvlink_share"],
        a2a_latency_us=2 * s["kernel_launch_us"],
        a2a_dedup=True,
        comm_sm_share=s["normal_kernel_sms"] / g.sms,
        ll_comm_sm_share=0.0,
        ll_dispatch_gbps=LL_DISPATCH_GBPS,
        ll_combine_gbps=LL_COMBINE_GBPS,
        normal_rdma_gbps=NORMAL_RDMA_GBPS if g.nic_gbps >= 50 else (),
        op_overhead_us=launch,
        decode_op_overhead_us=launch if graphs else eager,
        host_launch_us=s["kernel_launch_us"],
        launches_per_op=s["kernels_per_op"],
        decode_host_launch_us=0.0 if graphs else None,
        sources={"gpu": g.source, **SOURCES},
    )
