"""Routers, the bank of this rank's experts, and the MoE block's operations."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.context import ForwardContext
from moe_overlap.core.dispatcher import DispatchState, host_counts
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.transfer import to_device
from moe_overlap.model.layers import GatedMLP
from moe_overlap.model.router import Router
from moe_overlap.model.tensor_parallel import ColumnLinear, ModelParallel, even_part


class ExpertBank(nn.Module):
    """The routed experts this rank owns: global ids ``first .. first + count - 1``, stacked,
    each holding intermediate rows ``inter_rows`` of ``inter_full`` (moe-TP shards an expert's
    width; its outputs are then partial sums the dispatcher reduces).

    Each expert's gate and up projections are one ``[2 * intermediate, hidden]`` matrix (one
    matmul); the checkpoint keeps them as ``experts.N.gate_proj`` and ``experts.N.up_proj``
    (``model/loader.py: checkpoint_layout`` maps the names to the two halves).

    GPT-OSS's experts (``swiglu`` = (alpha, limit)) add biases and clamp their SwiGLU; with
    moe-TP the down projection's bias is added by the rank holding the first rows only.
    """

    def __init__(
        self,
        hidden: int,
        inter_full: int,
        first: int,
        count: int,
        inter_rows: range | None = None,
        swiglu: tuple[float, float] | None = None,
    ):
        super().__init__()
        inter_rows = inter_rows or range(inter_full)
        self.first, self.count = first, count
        self.inter_full, self.inter_start = inter_full, inter_rows.start
        self.intermediate = intermediate = len(inter_rows)
        self.gate_up_proj = nn.Parameter(torch.zeros(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(count, hidden, intermediate))
        self.swiglu = swiglu
        self.gate_up_proj_bias = self.down_proj_bias = None
        if swiglu is not None:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(count, 2 * intermediate))
            self.down_proj_bias = nn.Parameter(torch.zeros(count, hidden))

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.swiglu is None:
            return F.silu(gate) * up
        alpha, limit = self.swiglu
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def _down_bias(self) -> torch.Tensor | None:
        """The down projection's bias where this rank adds it (the first moe-TP rows)."""
        return self.down_proj_bias if self.inter_start == 0 else None

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """Run rows of ``x`` grouped by local expert (``tokens_per_expert[e]`` rows each)."""
        out = torch.empty_like(x)
        self.run_experts(x, tokens_per_expert, out, range(len(tokens_per_expert)))
        return out

    def run_dispatched(self, d: DispatchState) -> torch.Tensor:
        """The experts over a dispatch's rows: on the device's counts where they run as one
        grouped GEMM and the host has not read them (no read of the device at all), else on
        the host's."""
        x = d.expert_inputs
        assert x is not None, "the experts ran before the dispatch delivered their rows"
        if d.tokens_per_expert is None and d.counts is not None and self.grouped(x):
            offs = d.counts.cumsum(0, dtype=torch.int32)
            return self._grouped(x, offs, range(self.count))
        return self.forward(x, host_counts(d))

    def grouped(self, x: torch.Tensor) -> bool:
        return grouped_fits(x.device, x.dtype, (x.shape[1], self.intermediate))

    def run_experts(
        self, x: torch.Tensor, tokens_per_expert: list[int], out: torch.Tensor, experts: range
    ) -> None:
        """Write the rows of local experts ``experts`` (a contiguous range) into ``out``.

        Same rows and arithmetic as ``forward``, so running the experts block by block (SBO)
        gives bit-identical outputs: the path (batched or per expert) and the padded height
        depend on every expert's count, not on the block's.
        """
        ends = list(accumulate(tokens_per_expert, initial=0))
        rows = slice(ends[experts.start], ends[experts.stop])
        if rows.start == rows.stop:
            return
        if self.grouped(x):
            counts = tokens_per_expert[experts.start : experts.stop]
            offs = to_device(torch.tensor(list(accumulate(counts)), dtype=torch.int32), x.device)
            out[rows] = self._grouped(x[rows], offs, experts)
            return
        height = max(tokens_per_expert)
        if _batched_pays(tokens_per_expert, height):
            counts = tokens_per_expert[experts.start : experts.stop]
            out[rows] = self._padded(x[rows], counts, height, experts)
            return
        up_b, down_b = self.gate_up_proj_bias, self._down_bias()
        for e in experts:
            start, end = ends[e], ends[e + 1]
            if start == end:
                continue
            h = F.linear(x[start:end], self.gate_up_proj[e], None if up_b is None else up_b[e])
            down = None if down_b is None else down_b[e]
            out[start:end] = F.linear(self._act(h), self.down_proj[e], down)

    def _grouped(self, x: torch.Tensor, offs: torch.Tensor, experts: range) -> torch.Tensor:
        """The experts' rows as one grouped GEMM per projection, no padding: ``offs`` (int32, on
        the device) ends each expert's rows. An SBO block passes its slice of the rows and its
        experts' ends, so its groups are the whole forward's, cut at a boundary."""
        block = slice(experts.start, experts.stop)
        # weights [E, out, in] as [E, in, out] views: the column-major operand the kernel wants
        assert GROUPED_MM is not None, "grouped_fits chose a kernel this torch lacks"
        h = GROUPED_MM(x, self.gate_up_proj[block].transpose(1, 2), offs=offs)
        rows = None
        if self.gate_up_proj_bias is not None:  # each row's expert, from the device's offsets
            index = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
            rows = torch.searchsorted(offs, index, right=True)
            h = h + self.gate_up_proj_bias[block][rows]
        y = GROUPED_MM(self._act(h), self.down_proj[block].transpose(1, 2), offs=offs)
        down_b = self._down_bias()
        return y if down_b is None or rows is None else y + down_b[block][rows]

    def _padded(
        self, x: torch.Tensor, counts: list[int], height: int, experts: range
    ) -> torch.Tensor:
        """The experts' rows as one batched matmul per projection: each expert's rows padded
        with zeros to ``height`` (zero rows stay zero through SiLU and are dropped)."""
        n = len(counts)
        if all(c == height for c in counts):
            padded, where = x, None
        else:
            where = _padded_positions(counts, height, x.device)
            padded = x.new_zeros(n * height, x.shape[1]).index_copy_(0, where, x)
        block = slice(experts.start, experts.stop)
        rows = padded.view(n, height, -1)
        gate_up_w, down_w = self.gate_up_proj[block], self.down_proj[block]
        if n == 1:  # torch's bmm of one matrix sums in another order for some heights (5 rows
            # on CPU): as two it gives the bits a block of several experts gives (SBO's blocks)
            rows, gate_up_w, down_w = (t.expand(2, *t.shape[1:]) for t in (rows, gate_up_w, down_w))
        h = torch.bmm(rows, gate_up_w.transpose(1, 2))
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[block][:, None].expand(h.shape[0], 1, -1)
        y = torch.bmm(self._act(h), down_w.transpose(1, 2))
        down_b = self._down_bias()
        if down_b is not None:
            y = y + down_b[block][:, None].expand(y.shape[0], 1, -1)
        y = y[:n].flatten(0, 1)
        return y if where is None else y[where]


# When one batched matmul over every expert (each padded to the fullest) beats a matmul per
# expert: always for few rows per expert, where the loop's per-call overhead dominates; above
# that only while the padding stays small (the measurements behind the bounds: docs/tuning.md).
_BATCHED_ANY_ROWS = 64
_BATCHED_EVEN_ROWS = 192
_BATCHED_MAX_PADDING = 1.25


# torch's grouped GEMM: F.grouped_mm where this torch has it, else torch._grouped_mm (bf16 on
# CUDA): the experts run as one kernel per projection instead of one matmul per expert
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_fits(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
    """Whether the experts run as a grouped GEMM: torch has one, the rows are bf16 on an sm90+
    GPU (its kernel's target), and every row is 16-byte aligned (dims multiples of 8).
    Elsewhere, fp32 on CPU included, the padded batched matmul or the per-expert loop runs,
    unchanged. bf16 on ``meta`` (a dry run that counts a GPU's kernels, ``tools/device_ops.py``)
    takes the GPU's path."""
    if GROUPED_MM is None or device.type not in ("cuda", "meta") or dtype != torch.bfloat16:
        return False
    gpu = device.type == "meta" or _capability(device) >= (9, 0)
    return gpu and all(d % 8 == 0 for d in dims)


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _batched_pays(counts: list[int], height: int) -> bool:
    """Pad and batch when every expert is small, or evenly loaded and not large."""
    if height <= _BATCHED_ANY_ROWS:
        return True
    padded = height * len(counts)
    return height <= _BATCHED_EVEN_ROWS and padded <= _BATCHED_MAX_PADDING * sum(counts)


def _padded_positions(counts: list[int], height: int, device: torch.device) -> torch.Tensor:
    """Row i of expert e (in ``counts``' order) goes to padded row ``e * height + i`` (worked
    out on the host from the host's counts, then sent: no read of the device)."""
    sizes = torch.tensor(counts)
    expert = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    first = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return to_device(expert * height + torch.arange(expert.numel()) - first, device)


class SparseMoeBlock(nn.Module):
    """Router, this rank's experts and shared experts (DeepSeek's, or Qwen3.5's gated one),
    exposed as operations."""

    def __init__(self, cfg: ModelConfig, par: ModelParallel | None = None):
        super().__init__()
        par = par or ModelParallel.single()
        local = cfg.num_experts // par.ep_size
        self.gate = Router(cfg)
        self.experts = ExpertBank(
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            par.ep_rank * local,
            local,
            even_part(cfg.moe_intermediate_size, par.moe_tp_rank, par.moe_tp_size),
            (cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.is_gpt_oss else None,
        )
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, par.attn_tp
            )
        elif cfg.shared_expert_intermediate_size:  # Qwen3.5: one shared expert, gated per token
            self.shared_expert = GatedMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, par.attn_tp
            )
            self.shared_expert_gate = ColumnLinear(cfg.hidden_size, 1, range(1))
        self.has_shared = cfg.n_shared_experts > 0 or cfg.shared_expert_intermediate_size > 0

    def op_gate(self, ctx: ForwardContext) -> None:
        ctx.state.put(router_logits=self.gate.logits(ctx.state.get("mlp_in")))

    def op_select_experts(self, ctx: ForwardContext) -> None:
        ids, weights = self.gate.select(ctx.state.pop("router_logits"))
        ctx.state.put(topk_ids=ids, topk_weights=weights)

    def op_dispatch_a(self, ctx: ForwardContext) -> None:
        s = ctx.state
        x = s.get("mlp_in") if self.has_shared else s.pop("mlp_in")
        ids, weights = s.pop("topk_ids"), s.pop("topk_weights")
        extend = not all(ctx.batch.is_decode)  # padding rules differ for prefill and decode
        s.put(dispatch=ctx.dispatcher.dispatch_a(x, ids, weights, owner=ctx.name, extend=extend))

    def op_dispatch_b(self, ctx: ForwardContext) -> None:
        ctx.dispatcher.dispatch_b(ctx.state.get("dispatch"))

    def op_experts(self, ctx: ForwardContext) -> None:
        d = ctx.state.get("dispatch")
        d.expert_outputs = self.experts.run_dispatched(d)

    def op_combine_a(self, ctx: ForwardContext) -> None:
        ctx.dispatcher.combine_a(ctx.state.get("dispatch"))

    def op_combine_b(self, ctx: ForwardContext) -> None:
        ctx.state.put(moe_out=ctx.dispatcher.combine_b(ctx.state.pop("dispatch")))

    def op_shared_experts(self, ctx: ForwardContext) -> None:
        x = ctx.state.pop("mlp_in")
        if self.shared_experts is not None:
            ctx.state.put(shared_out=self.shared_experts(x))
            return
        gate = torch.sigmoid(self.shared_expert_gate(x))
        ctx.state.put(shared_out=gate * self.shared_expert(x))
