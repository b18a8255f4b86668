"""The seconds each operation of a layer takes for one micro-batch on each rank.

The sizes (weights per op, FLOPs per query-key pair, KV per key) are the model's one cost model,
``core/model_flops.py: op_sizes``; this file turns them into time on a cluster.

Each op's time is ``max(FLOPs / rate, bytes / HBM rate) + a fixed overhead``: GEMMs at the
cluster's GEMM rate (FP8 weights at the FP8 rate), attention at its own rate with FLOPs that grow
with the query-key pairs computed (where the cluster says a chunk with a prefix computes its
whole rectangle, the engine's blocks of ``QUERY_BLOCK`` queries each over the keys up to its
end), weights and KV read once per micro-batch. An all-to-all moves ``rows x hidden``
activations (the dispatch's FP8 with a float32 scale per 128 under ``--moe-dispatch-dtype fp8``,
the combine's in the run dtype), rows from top-k routing spread evenly over the EP ranks, or by
the cluster's measured ``expert_shares``. Under ``expert_imbalance`` (``plan --balancedness``)
every MoE layer is timed at its busiest rank: its experts' rows and the bytes it receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.errors import ConfigError
from moe_overlap.core.model_flops import op_sizes
from moe_overlap.planner.cluster import Cluster, ep_rate
from moe_overlap.planner.hybrid import with_linear_layers
from moe_overlap.planner.inputs import ModelSpec, PlanLayout
from moe_overlap.planner.work import Work, masked_pairs

__all__ = ["CostModel", "MicroBatchCost", "Work", "masked_pairs"]

ELEMENTWISE = ("prepare_attn", "prepare_mlp", "select_experts", "output")


@dataclass
class MicroBatchCost:
    """Per op name, per rank: compute seconds; and each rank's all-to-all bytes."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    a2a_bytes: list[list[float]] = field(default_factory=list)  # per rank (NVLink, RDMA)
    combine_bytes: list[list[float]] = field(default_factory=list)  # the same, combine's
    allreduce_s: list[float] = field(default_factory=list)  # attention TP's, inside attn_core
    op_overhead_s: float = 0.0  # the fixed cost inside each op's seconds (one call's)
    decode: bool = False  # every token decodes (CUDA graphs, low-latency all-to-alls)
    link_s: dict[str, list[float]] = field(default_factory=dict)  # low-latency kernels: per
    # kind (dispatch, combine), each rank's seconds; empty: the bytes over the links
    latency_s: float = 0.0  # an all-to-all's fixed time besides its bytes
    sm_share: float = 0.0  # share of compute lost while this micro-batch's transfer is out
    host_launch_s: float = 0.0  # the host's time to launch one of its device operations

    def bytes_of(self, kind: str) -> list[list[float]]:
        """Each rank's bytes of a ``kind`` all-to-all: the combine's rows are in the run dtype
        (no smaller than the dispatch's, which may be FP8)."""
        return self.combine_bytes if kind == "combine" and self.combine_bytes else self.a2a_bytes


def node_hit_chance(groups: int, top_groups: int, nodes: int, k: int) -> float:
    """The chance that a token reaches a given other node. Group-limited routing (DeepSeek-V3:
    ``topk_group`` of ``n_group`` expert groups per token) with whole groups per node: the
    node is missed when every chosen group lies elsewhere; otherwise each of the ``k``
    experts lands anywhere."""
    if nodes < 2:
        return 0.0
    if groups > 1 and groups % nodes == 0:
        others = groups - groups // nodes
        return 1 - math.comb(others, top_groups) / math.comb(groups, top_groups)
    return 1 - (1 - 1 / nodes) ** k


class CostModel:
    """Op times of ``spec`` on ``cluster`` under ``layout``."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, layout: PlanLayout):
        self.spec, self.cluster, self.layout = spec, cluster, layout
        self.gemm = cluster.gemm_flops_per_s(spec.fp8_weights)
        self.attn = cluster.attention_flops_per_s
        self.hbm = cluster.hbm_bytes_per_s
        self.over = cluster.op_overhead_us * 1e-6
        self._decode_over = (
            self.over
            if cluster.decode_op_overhead_us is None
            else cluster.decode_op_overhead_us * 1e-6
        )
        self._fixed = self.over  # the current micro-batch's per-op cost (``micro_batch``)
        c = spec.cfg
        self.sizes = op_sizes(c, layout.attn_tp)
        self.local_experts = layout.slots_per_gpu(c)  # each slot's weights are read apart
        shares = cluster.expert_shares
        if shares and len(shares) != layout.world:
            raise ConfigError(
                f"cluster {cluster.name}: {len(shares)} expert_shares for a layout of "
                f"{layout.world} ranks (EP {layout.ep}): give one share per rank, or none"
            )
        self.shares = shares or (1 / layout.ep,) * layout.world
        # the busiest rank's rows over the mean also scale its bytes, unless measured shares
        # already say where the rows go
        self.hot_bytes = 1.0 if shares or layout.ep == 1 else cluster.expert_imbalance

    def op_overhead(self, decode: bool) -> float:
        """One op call's fixed seconds (decode's: under CUDA graphs where the cluster says)."""
        return self._decode_over if decode else self.over

    def kernel_seconds(
        self,
        flops: float,
        weights: float,
        act: float,
        rate: float | None = None,
        rows: float = 0.0,
        groups: float = 1.0,
    ) -> float:
        """``max(FLOPs / rate, bytes / HBM) + fixed``; a GEMM of ``rows`` rows split over
        ``groups`` (grouped experts) computes whole row tiles at its rows' efficiency."""
        byte_time = (weights * self.spec.weight_bytes + act) / self.hbm
        rate = rate or self.gemm
        if rows > 0 and flops > 0:
            m = rows / groups
            tile = self.cluster.gemm_row_tile
            padded = math.ceil(m / tile) * tile  # computed rows, at their efficiency
            flops *= padded / m
            half = self.cluster.gemm_half_rows
            rate *= padded / (padded + half) if half else 1.0
        return max(flops / rate, byte_time) + self._fixed

    def micro_batch(self, children: list[ForwardBatch]) -> MicroBatchCost:
        """``children[r]``: rank r's micro-batch (idle ranks: an empty batch)."""
        rect = self.cluster.attention_full_rectangle_with_prefix
        window = self.sizes.window
        works = [Work.of(b, self.layout.attn_tp, rect, window) for b in children]
        routed = self.spec.cfg.num_experts_per_tok * sum(w.moe_tokens for w in works)
        hot = self.cluster.expert_imbalance if self.layout.ep > 1 else 1.0
        received = routed / self.layout.ep * hot  # the busiest rank's: the layer waits for it
        decode = all(w.decode_tokens == w.tokens for w in works)
        self._fixed = self.op_overhead(decode)
        cl = self.cluster
        low_latency = decode and cl.low_latency and self.layout.ep > 1
        out = MicroBatchCost(
            op_overhead_s=self._fixed,
            decode=decode,
            latency_s=0.0 if low_latency or self.layout.ep == 1 else cl.a2a_latency_us * 1e-6,
            sm_share=cl.ll_comm_sm_share if low_latency else cl.comm_sm_share,
            host_launch_s=cl.host_launch_s(decode),
        )
        for w, share in zip(works, self.shares, strict=True):
            for name, s in self.op_seconds(w, received).items():
                out.seconds.setdefault(name, []).append(s)
            out.a2a_bytes.append(self.a2a_bytes(w.moe_tokens, routed, share, self.dispatch_elem))
            out.combine_bytes.append(self.a2a_bytes(w.moe_tokens, routed, share))
            out.allreduce_s.append(self.allreduce_seconds(w.tokens))
            if low_latency:
                for kind, secs in self.low_latency_seconds(w.moe_tokens).items():
                    out.link_s.setdefault(kind, []).append(secs)
        return out

    def low_latency_seconds(self, moe_tokens: float) -> dict[str, float]:
        """DeepEP's low-latency kernels: every top-k copy of a token is sent (FP8 with a
        scale per 128 in dispatch under ``--moe-dispatch-dtype fp8``, BF16 in combine), at the
        bandwidth the kernels reached at this EP size (``cluster.ll_*_gbps``)."""
        c, cl, ep = self.spec.cfg, self.cluster, self.layout.ep
        copies = moe_tokens * c.num_experts_per_tok * c.hidden_size
        out_bytes = copies * self.dispatch_elem
        back_bytes = copies * cl.activation_bytes
        hot = self.hot_bytes  # the busiest rank receives (and sends back) the most
        return {
            "dispatch": out_bytes * hot / (ep_rate(cl.ll_dispatch_gbps, ep) * 1e9),
            "combine": back_bytes * hot / (ep_rate(cl.ll_combine_gbps, ep) * 1e9),
        }

    @property
    def dispatch_elem(self) -> float:
        """Bytes per element the dispatch sends: FP8 and its scales, or the run dtype's."""
        return self.spec.dispatch_bytes(self.cluster.activation_bytes)

    def a2a_bytes(
        self, moe_tokens: float, routed: float, share: float, per_elem: float | None = None
    ) -> list[float]:
        """(intra-node, inter-node) bytes that leave (or reach) the rank: the engine's
        max(sent, received) rows off-rank (``routed``: every rank's rows, ``share`` of them
        go to this rank's experts), or with ``a2a_dedup`` one copy per GPU (NVLink)
        and per node (RDMA) a token reaches; ``per_elem`` bytes per element (default: the
        run dtype's, the combine's; an FP8 dispatch's are ``1 + 4 / 128``)."""
        c, ep, cl = self.spec.cfg, self.layout.ep, self.cluster
        k, per_node = c.num_experts_per_tok, min(ep, cl.gpus_per_node)
        row = c.hidden_size * (cl.activation_bytes if per_elem is None else per_elem)
        if ep == 1:
            return [0.0, 0.0]
        row *= cl.a2a_bytes_factor
        if cl.a2a_dedup:
            nodes = ep // per_node
            gpus_hit = (ep - 1) * (1 - (1 - 1 / ep) ** k)
            nodes_hit = (nodes - 1) * node_hit_chance(c.n_group, c.topk_group, nodes, k)
            row *= self.hot_bytes
            return [moe_tokens * gpus_hit * row, moe_tokens * nodes_hit * row]
        own = k * moe_tokens
        rows = max(own * (1 - share), (routed - own) * share * self.hot_bytes)
        inside = (per_node - 1) / (ep - 1)
        return [rows * inside * row, rows * (1 - inside) * row]

    def allreduce_seconds(self, tokens: int) -> float:
        tp = self.layout.attn_tp
        if tp == 1:
            return 0.0
        rate = (self.cluster.allreduce_gbps or self.cluster.intra_node_a2a_gbps) * 1e9
        nbytes = 2 * (tp - 1) / tp * tokens * self.spec.cfg.hidden_size * 2
        return nbytes / rate + self.cluster.a2a_latency_us * 1e-6

    def op_seconds(self, w: Work, received: float) -> dict[str, float]:
        c, cl, s = self.spec.cfg, self.cluster, self.sizes
        h, act = c.hidden_size, cl.activation_bytes
        row = h * act
        prepare, core, kv_per_key = self._attention(w)
        experts_active = self.local_experts * (1 - math.exp(-received / self.local_experts))
        expert_w, shared_w = s.expert, s.shared
        out = {
            "attn_prepare": prepare,
            "attn_core": core
            + kv_per_key * w.keys / cl.kv_bytes_per_s
            + w.prefill_pieces * cl.seq_overhead_us * 1e-6
            + w.decode_tokens * cl.decode_seq_overhead_us * 1e-6,
            "gate": self.kernel_seconds(
                2 * w.moe_tokens * s.gate, s.gate, w.moe_tokens * row, rows=w.moe_tokens
            ),
            "dispatch_a": self.kernel_seconds(0, 0, 2 * c.num_experts_per_tok * w.moe_tokens * row),
            "dispatch_b": self.kernel_seconds(0, 0, 2 * received * row),
            "experts": self.kernel_seconds(
                2 * received * expert_w,
                experts_active * expert_w,
                3 * received * row,
                rows=received,
                groups=max(experts_active, 1e-9),
            )
            + experts_active * cl.expert_overhead_us * 1e-6,
            "switch": cl.switch_overhead_us * 1e-6,
            "combine_a": self.kernel_seconds(0, 0, 2 * received * row),
            "combine_b": self.kernel_seconds(0, 0, 2 * c.num_experts_per_tok * w.moe_tokens * row),
            "shared_experts": self.kernel_seconds(
                2 * w.moe_tokens * shared_w, shared_w, 3 * w.moe_tokens * row, rows=w.moe_tokens
            ),
            "dense_mlp": self.kernel_seconds(
                2 * w.tokens * s.dense, s.dense, 3 * w.tokens * row, rows=w.tokens
            ),
            "embed": self.kernel_seconds(0, 0, 2 * w.tokens * row),
            "logits": self.kernel_seconds(2 * w.pieces * s.logits, s.logits, 0, rows=w.pieces),
        }
        for name in ELEMENTWISE:
            out[name] = self.kernel_seconds(0, 0, 3 * w.tokens * row)
        return out

    def _attention(self, w: Work) -> tuple[float, float, float]:
        """(attn_prepare seconds, attn_core seconds before KV reads, KV bytes per cached key
        still to read: none where a fused decode kernel has read them)."""
        c, s, act = self.spec.cfg, self.sizes, self.cluster.activation_bytes
        h, t = c.hidden_size, w.tokens
        prep_w, o_w, up_w = s.attn_prepare, s.attn_output, s.attn_up
        prefill = t - w.decode_tokens
        # MLA: prefill decompresses every key it reads (MHA form); decode absorbs (MQA form)
        up_flops = 2 * (w.keys if prefill else 0) * up_w + 2 * w.decode_tokens * up_w
        kv_per_key = s.kv_elements * act
        prepare = self.kernel_seconds(2 * t * prep_w, prep_w, 2 * t * h * act, rows=t)
        core = self.kernel_seconds(up_flops + 2 * t * o_w, up_w + o_w, 2 * t * h * act, rows=t)
        decode_rate = self.cluster.decode_attention_tflops * 1e12
        kv_rate = self.cluster.kv_bytes_per_s

        def pairs_seconds(pairs: float, keys: int) -> tuple[float, float]:
            """(seconds, KV bytes per key still to read) of ``pairs`` over ``keys``."""
            flops = pairs * (s.pair_flops if prefill else s.decode_pair_flops)
            if decode_rate and w.decode_tokens == t:  # one fused kernel (FlashMLA): compute
                # or KV reads bound it, not their sum
                return max(flops / decode_rate, kv_per_key * keys / kv_rate), 0.0
            return flops / self.attn, kv_per_key

        attn_s, kv_left = pairs_seconds(w.pairs, w.keys)
        if c.is_hybrid:  # most layers are linear attention (planner/hybrid.py)
            return with_linear_layers(self, w, prepare, core + attn_s, kv_left)
        if s.sliding_share:  # sliding layers: their pairs and KV reads stop at the window
            sliding = s.sliding_share / s.full_share
            win_s, win_left = pairs_seconds(w.window_pairs, w.window_keys)
            win_s += win_left * w.window_keys / kv_rate
            attn_s, kv_left = (1 - sliding) * attn_s + sliding * win_s, (1 - sliding) * kv_left
        return prepare, core + attn_s, kv_left

    def link_seconds(self, nbytes: list[float]) -> float:
        """A transfer's time on one rank's links (no latency): NVLink and RDMA at once."""
        cl, ep = self.cluster, self.layout.ep
        if cl.normal_rdma_gbps and ep > cl.gpus_per_node:
            return nbytes[1] / (ep_rate(cl.normal_rdma_gbps, ep) * 1e9)
        return max(
            nbytes[0] / (cl.intra_node_a2a_gbps * 1e9), nbytes[1] / (cl.inter_node_a2a_gbps * 1e9)
        )
