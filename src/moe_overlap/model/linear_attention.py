"""Qwen3.5-MoE's Gated DeltaNet layer: linear attention over a per-sequence recurrent state.

``prepare`` is the projections (per token, no cache); ``core`` reads each sequence's conv and
SSM state from the context's ``StateCache``, runs the causal conv and the gated delta rule
(chunked for a prefill piece, token by token for decode steps, batched), writes the new states
and projects out. ``core`` is where a cut sequence's later piece depends on the earlier one:
the overlap engine runs it for micro-batch i only after micro-batch i-1 ran it at the same layer
(the stage order), and the cache's ``read`` refuses any other order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_overlap.core.batch import ForwardBatch
from moe_overlap.core.context import ForwardContext
from moe_overlap.core.model_config import ModelConfig
from moe_overlap.core.model_flops import linear_split
from moe_overlap.core.state_snapshots import StateSnapshots
from moe_overlap.distributed.groups import Group
from moe_overlap.model import delta_rule
from moe_overlap.model.tensor_parallel import ColumnLinear, RowLinear, Segments, set_shard


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values, then times SiLU of the gate ``z``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x.to(dtype) * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Parameter names as the checkpoint's ``linear_attn``: ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``.

    Under attention TP the heads are split over the group, as SGLang splits them: each rank
    holds its share of the key heads and of the value heads (value heads share a key head in
    contiguous runs, so a share keeps its own), the fused ``in_proj_qkv`` and the conv taking
    that share of each of their query, key and value parts, ``out_proj`` all-reducing; each
    rank's recurrent state is its heads'. Where the heads do not divide over the group the
    layer is replicated instead: every rank computes it whole, and nothing is reduced."""

    def __init__(self, cfg: ModelConfig, layer_id: int, group: Group | None = None):
        super().__init__()
        group = group or Group.single()
        if linear_split(cfg, group.size) == 1:
            group = Group.single()  # replicated (above)
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.layer_id = layer_id
        h, t, r = cfg.hidden_size, group.size, group.rank
        self.k_heads, self.v_heads = k_heads // t, v_heads // t  # this rank's
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.channels = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        full_key = k_heads * self.dk
        parts = Segments(  # this rank's queries, keys and values of the fused projection
            0,
            (
                (r * self.key_dim, self.key_dim),
                (full_key + r * self.key_dim, self.key_dim),
                (2 * full_key + r * self.value_dim, self.value_dim),
            ),
            2 * full_key + v_heads * self.dv,
        )
        self.in_proj_qkv = ColumnLinear.segments(h, parts.full, parts)
        self.in_proj_z = ColumnLinear.even(h, v_heads * self.dv, group)
        self.in_proj_b = ColumnLinear.even(h, v_heads, group)
        self.in_proj_a = ColumnLinear.even(h, v_heads, group)
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [channels, 1, kernel]
        self.conv1d.weight = nn.Parameter(torch.zeros(self.channels, 1, self.kernel))
        self.conv1d.weight.shard = parts.simplest()  # type: ignore[attr-defined]  # likewise
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        for per_head in (self.dt_bias, self.A_log):
            set_shard(per_head, 0, r * self.v_heads, v_heads)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)  # one weight for every head
        self.out_proj = RowLinear(v_heads * self.dv, h, group)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, SSM state) of one sequence."""
        return (self.channels, self.kernel - 1), (self.v_heads, self.dk, self.dv)

    def prepare(self, ctx: ForwardContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)

    def core(
        self,
        ctx: ForwardContext,
        mixed: torch.Tensor,
        z: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
    ) -> torch.Tensor:
        batch, cache = ctx.batch, ctx.states
        if cache is None:
            raise RuntimeError("a linear-attention layer ran without a recurrent-state cache")
        conv_in, ssm_in = cache.read(self.layer_id, batch.slots, batch.prefix_lens)
        weight = self.conv1d.get_parameter("weight")[:, 0]
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = mixed.new_empty(mixed.shape[0], self.v_heads, self.dv)
        conv_out, ssm_out = torch.empty_like(conv_in), torch.empty_like(ssm_in)
        rows = list(batch.per_sequence())
        lengths = [span.stop - span.start for _, _, span in rows]
        verify, runs = _token_runs(batch, lengths)
        for n, seqs in runs.items():
            if not seqs:
                continue
            idx = torch.tensor(
                [rows[i][2].start + t for i in seqs for t in range(max(n, 1))], device=mixed.device
            )
            at = torch.tensor(seqs, device=mixed.device)
            every: list[torch.Tensor] | None = [] if n else None  # verify: each row's state
            o, conv_out[at], ssm_out[at], window = self._steps(
                mixed[idx], conv_in[at], ssm_in[at], weight, g[idx], beta[idx], every
            )
            out[idx] = o.to(out.dtype)
            if every is not None:
                slots, starts = [batch.slots[i] for i in seqs], [batch.prefix_lens[i] for i in seqs]
                cache.keep(self.layer_id, slots, starts, window, torch.stack(every, dim=1))
        snapshots = cache.snapshots
        for i, (slot, prefix, span) in enumerate(rows):
            if lengths[i] == 1 or verify[i]:
                continue
            cuts = snapshots.cuts(slot, prefix, prefix + span.stop - span.start - 1)
            o, conv_out[i], ssm_out[i] = self._prefill(
                mixed[span],
                conv_in[i],
                ssm_in[i],
                weight,
                g[span],
                beta[span],
                prefix,
                cuts,
                snapshots,
            )
            out[span] = o.to(out.dtype)
        cache.write(self.layer_id, batch.slots, batch.seq_lens, conv_out, ssm_out)
        for i, (slot, end) in enumerate(zip(batch.slots, batch.seq_lens, strict=True)):
            for _, entry in snapshots.cuts(slot, end - 1, end):  # the state the piece leaves
                snapshots.keep(self.layer_id, entry, conv_out[i], ssm_out[i])
        y = self.norm(out, z.view(-1, self.v_heads, self.dv))
        return self.out_proj(y.reshape(y.shape[0], self.value_dim))

    def _steps(
        self,
        x: torch.Tensor,
        conv: torch.Tensor,
        ssm: torch.Tensor,
        weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        every: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences of ``conv [seqs, ...]`` and ``ssm``, ``n`` rows each (``x [seqs * n,
        channels]``, sequence by sequence), token by token from those states: the outputs
        ``[seqs * n, heads, dv]``, the conv and SSM states after them, and the conv window
        ``[seqs, channels, kernel - 1 + n]`` (the inputs before and the rows'); ``every``
        gets the SSM state after each row."""
        seqs = conv.shape[0]
        n = x.shape[0] // seqs
        window = torch.cat((conv, x.view(seqs, n, -1).transpose(1, 2)), dim=2)
        # each row's conv as a decode step computes it: its window times the weight, summed
        mixed = (window.unfold(2, self.kernel, 1) * weight[:, None, :]).sum(dim=-1)
        q, k, v = self._qkv(F.silu(mixed).transpose(1, 2).contiguous())
        g, beta = g.view(seqs, n, -1), beta.view(seqs, n, -1)
        o, ssm = delta_rule.recurrent(q, k, v, g, beta, ssm, every)
        return o.reshape(seqs * n, *o.shape[2:]), window[:, :, n:], ssm, window

    def _prefill(
        self,
        mixed: torch.Tensor,
        conv_in: torch.Tensor,
        ssm_in: torch.Tensor,
        weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        prefix: int,
        cuts: list[tuple[int, int]],
        snapshots: StateSnapshots,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's piece of tokens after ``prefix``: its outputs, conv and SSM states.
        At each of ``cuts`` (boundary, snapshot entry) inside the piece the state after exactly
        that boundary is kept (the delta rule reads it off the boundary's chunk: one small
        matmul a cut)."""
        x, conv_out = delta_rule.causal_conv(mixed, conv_in, weight)
        q, k, v = self._qkv(x)
        keep = [b - prefix for b, _ in cuts]
        out, state, kept = delta_rule.chunked(q, k, v, g, beta, ssm_in, prefix, keep)
        inputs = torch.cat((conv_in, mixed.t()), dim=1)  # the conv's inputs, its state first
        for r, (_, entry), ssm in zip(keep, cuts, kept, strict=True):
            conv = inputs[:, r : r + self.kernel - 1]  # the kernel - 1 inputs before the cut
            snapshots.keep(self.layer_id, entry, conv, ssm)
        return out, conv_out, state

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the conv's output ``[.., n, channels]`` into normalised, scaled queries and
        keys (repeated to the value heads) and values."""
        q, k, v = x.float().split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        lead = x.shape[:-1]
        q, k = (t.view(*lead, self.k_heads, self.dk) for t in (q, k))
        repeat = self.v_heads // self.k_heads
        if repeat > 1:
            q, k = (t.repeat_interleave(repeat, dim=-2) for t in (q, k))
        q = delta_rule.l2_normalize(q) * self.dk**-0.5
        return q, delta_rule.l2_normalize(k), v.reshape(*lead, self.v_heads, self.dv)


def _token_runs(batch: ForwardBatch, lengths: list[int]) -> tuple[list[bool], dict[int, list[int]]]:
    """Which sequences are verify rows, and the sequences that run token by token, grouped by
    their rows: a verify sequence's rows (its last token and drafts, or a piece of them) run
    as decode does, keeping the state after each row for the rollback (key: its row count);
    key 0: the decode sequences (one token each, no state kept)."""
    verify = [d and every for d, every in zip(batch.is_decode, batch.all_logits, strict=True)]
    runs = {n: [i for i, v in enumerate(verify) if v and lengths[i] == n] for n in lengths}
    runs[0] = [i for i, n in enumerate(lengths) if n == 1 and not verify[i]]
    return verify, runs
