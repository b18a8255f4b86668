"""The bank of this rank's routed experts and the kernels that run them."""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.dispatcher import DispatchState, host_counts
from moe_overlap.core.transfer import to_device
from moe_overlap.dispatch.fp8_rows import Fp8Rows
from moe_overlap.dispatch.low_latency import group_places
from moe_overlap.model.expert_paths import GROUPED_MM, batched_pays, grouped_fits, padded_positions
from moe_overlap.model.fp8_w8a8 import W8A8Experts


class ExpertBank(nn.Module):
    """The routed experts this rank owns: physical slots ``first .. first + count - 1``, slot
    ``i`` holding checkpoint expert ``logical[i]`` (the slot's own id without EPLB), stacked,
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
        logical: tuple[int, ...] | None = None,
    ):
        super().__init__()
        inter_rows = inter_rows or range(inter_full)
        self.first, self.count = first, count
        # the checkpoint expert each slot holds (EPLB: a replica's slot holds a copy)
        self.logical = logical if logical is not None else tuple(range(first, first + count))
        self.inter_full, self.inter_start = inter_full, inter_rows.start
        self.intermediate = intermediate = len(inter_rows)
        self.gate_up_proj = nn.Parameter(torch.zeros(count, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(count, hidden, intermediate))
        self.swiglu = swiglu
        self.w8a8: W8A8Experts | None = None  # on a GPU, FP8 experts as scaled GEMMs
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
        """The experts over a dispatch's rows. Where they run as one grouped GEMM its output is
        returned as it is, the row ends taken from the device's counts where the host has not
        read them (no read of the device at all), else from the host's; else the host's counts
        drive ``run_experts`` into a buffer."""
        if d.capacity:
            out = d.empty_outputs()
            self.run_block(d, out, range(self.count))
            return out
        x, wire = self._inputs(d)
        counts = d.counts if d.tokens_per_expert is None else None  # on the device, unread
        # the kernel's output is the outputs (no copy into a buffer); no rows: nothing to run
        if self.on_device(x) and (counts is not None or x.shape[0]):
            if counts is not None:
                ends = counts.cumsum(0, dtype=torch.int32)
            else:
                ends = _device_ends(host_counts(d), x.device)
            y = self._on_device(x, ends, range(self.count), wire)
            if y is not None:
                return y
        out = d.empty_outputs()
        self.run_experts(x, host_counts(d), out, range(self.count), wire)
        return out

    def _inputs(self, d: DispatchState) -> tuple[torch.Tensor, Fp8Rows | None]:
        """The rows as the experts read them: the FP8 dispatch's rows as they arrived, with
        their form, where the grouped FP8 kernel takes them (no decode, no second
        quantization); else in the run dtype, with None."""
        w8a8 = self.w8a8
        if isinstance(d.wire, Fp8Rows) and w8a8 is not None and w8a8.grouped and not w8a8.failed:
            assert d.arrived is not None
            return d.arrived, d.wire
        x = d.expert_inputs
        assert x is not None, "the experts ran before the dispatch delivered their rows"
        return x, None

    def run_block(self, d: DispatchState, out: torch.Tensor, experts: range) -> None:
        """Write the outputs of local experts ``experts`` (SBO's block, or all) into ``out``,
        which is laid out as ``d.expert_inputs``."""
        x, wire = self._inputs(d)
        if not d.capacity:
            self.run_experts(x, host_counts(d), out, experts, wire)
        elif d.counts is None:
            raise RuntimeError(f"{d.owner}: a low-latency dispatch delivered rows without counts")
        else:
            self.run_capacity(x, d.counts, out, experts, wire, d.topk_weights.shape[1])

    def run_capacity(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        experts: range,
        wire: Fp8Rows | None = None,
        top_k: int | None = None,
    ) -> None:
        """The low-latency layout: ``x`` and ``out`` are ``[ep, 1 + local * capacity, hidden]``,
        each source rank's block a spare row (the dispatch's header) then ``capacity`` rows
        per local expert, of which the first ``counts[p, e]`` (on the device) are real; each
        output row goes where its input was. As one launch per projection over the real rows
        gathered expert by expert (``on_device``: the grouped FP8 kernel, or bf16 grouped GEMM
        on sm90+), else one batched matmul over every padded row (the padding's outputs are
        never read). ``wire``: ``x`` is the FP8 dispatch's blocks as they arrived
        (``_inputs``). ``top_k``: the experts a token picks, which bounds the real rows (a
        source's at most ``capacity`` tokens each reach at most ``min(top_k, len(experts))``
        of these experts), so fewer are gathered; None: every padded place."""
        ep, block_rows, _ = x.shape
        cap, n = (block_rows - 1) // self.count, len(experts)
        most = ep * cap * min(top_k or n, n)
        if self.on_device(x) and self._capacity_on_device(x, counts, out, experts, wire, most):
            return
        x = x if wire is None else wire.decode(x)  # the kernel gave up: the run dtype
        hidden = x.shape[-1]
        padded = x[:, 1:].view(ep, self.count, cap, hidden)[:, experts.start : experts.stop]
        rows = padded.transpose(0, 1).reshape(n * ep * cap, hidden)
        y = self._padded(rows, [ep * cap] * n, ep * cap, experts)
        places = out[:, 1:].view(ep, self.count, cap, hidden)[:, experts.start : experts.stop]
        places.copy_(y.view(n, ep, cap, hidden).transpose(0, 1))

    def _capacity_on_device(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        out: torch.Tensor,
        experts: range,
        wire: Fp8Rows | None,
        most: int,
    ) -> bool:
        """``run_capacity``'s real rows (at most ``most``) gathered expert by expert, one launch
        per projection (``_on_device``), and written back to their places; False, with
        nothing written, where that could not run. Both ways are gathers: on a GPU an indexed
        store runs CUDA's element-by-element index kernel, a gather of whole rows vectorized."""
        ep, block_rows, width = x.shape
        n, cap = len(experts), (block_rows - 1) // self.count
        per_group = counts[:, experts.start : experts.stop].T.reshape(-1)  # (expert, source)
        ends = per_group.cumsum(0)
        starts = ends - per_group
        row = torch.arange(most, device=x.device)
        group = torch.searchsorted(ends, row, right=True).clamp_(max=n * ep - 1)
        # each gathered row's place in the blocks (past the real rows: a place never read back)
        shift = group_places(ep, block_rows, self.count, experts, x.device) - starts
        place = (row + shift[group]).clamp_(max=ep * block_rows - 1)
        offs = ends.view(n, ep)[:, -1].int()  # each expert's last gathered row + 1
        y = self._on_device(x.view(-1, width)[place], offs, experts, wire)
        if y is None:
            return False
        # each of these experts' places in the blocks, the gathered row it holds (a padding
        # place: any row; its output is never read)
        back = starts.view(n, ep).T[..., None] + torch.arange(cap, device=x.device)
        places = out[:, 1 + experts.start * cap : 1 + experts.stop * cap]
        places.view(ep, n, cap, -1).copy_(y[back.clamp_(max=most - 1)])
        return True

    def grouped(self, x: torch.Tensor) -> bool:
        return grouped_fits(x.device, x.dtype, (x.shape[-1], self.intermediate))

    def on_device(self, x: torch.Tensor) -> bool:
        """Whether the experts run on the device's row ends, one launch per projection: a W8A8
        bank through the grouped FP8 kernel, any other through the bf16 grouped GEMM."""
        if self.w8a8 is not None and not self.w8a8.failed:
            return self.w8a8.grouped
        return self.grouped(x)

    def _on_device(
        self, x: torch.Tensor, offs: torch.Tensor, experts: range, wire: Fp8Rows | None = None
    ) -> torch.Tensor | None:
        """``experts``' rows ``x`` (ends ``offs``, int32 on the device; FP8 wire rows where
        ``wire``) as ``on_device`` says; None where the FP8 kernel gave up (the per-expert
        GEMMs run from then on)."""
        if self.w8a8 is not None and not self.w8a8.failed:
            return self.w8a8.run_grouped(x, offs, experts, self._act, wire)
        return self._grouped(x, offs, experts)

    def run_experts(
        self,
        x: torch.Tensor,
        tokens_per_expert: list[int],
        out: torch.Tensor,
        experts: range,
        wire: Fp8Rows | None = None,
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
        if self.on_device(x):
            offs = _device_ends(tokens_per_expert[experts.start : experts.stop], x.device)
            y = self._on_device(x[rows], offs, experts, wire)
            if y is not None:
                out[rows] = y
                return
        x = x if wire is None else wire.decode(x)  # the kernel gave up: the run dtype
        if self.w8a8 is not None and self.w8a8.run(x, ends, out, experts, self._act):
            return
        height = max(tokens_per_expert)
        if batched_pays(tokens_per_expert, height):
            counts = tokens_per_expert[experts.start : experts.stop]
            out[rows] = self._padded(x[rows], counts, height, experts)
            return
        up_b, down_b = self.gate_up_proj_bias, self._down_bias()
        gate_up_w, down_w = self.gate_up_proj, self.down_proj  # read once (FP8: dequantized)
        for e in experts:
            start, end = ends[e], ends[e + 1]
            if start == end:
                continue
            h = F.linear(x[start:end], gate_up_w[e], None if up_b is None else up_b[e])
            down = None if down_b is None else down_b[e]
            out[start:end] = F.linear(self._act(h), down_w[e], down)

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
            where = padded_positions(counts, height, x.device)
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


def _device_ends(counts: list[int], device: torch.device) -> torch.Tensor:
    """Each expert's last row + 1 among rows grouped by expert (``counts`` rows each), int32 on
    ``device``: the offsets a grouped GEMM reads."""
    return to_device(torch.tensor(list(accumulate(counts)), dtype=torch.int32), device)
