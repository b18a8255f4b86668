"""The gated delta rule (Gated DeltaNet's token mixer) in plain torch, and its causal conv.

Per head, with state ``S [dk, dv]``, each token decays the state by ``exp(g)``, corrects what
the state predicts for its key towards its value (learning rate ``beta``) and reads it with its
query::

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q

``recurrent`` runs that token by token (decode); ``chunked`` runs the same recurrence a chunk
of tokens at a time (prefill), solving each chunk's corrections as one triangular system. Both
take one sequence's ``q, k [n, heads, dk]`` (already normalised and scaled), ``v [n, heads,
dv]``, ``g, beta [n, heads]`` and the state before them, and return the outputs and the state
after them, so a sequence cut anywhere continues exactly from the cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens solved together; transformers' torch reference uses the same


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of one sequence's ``x [n, channels]`` continuing from ``state
    [channels, kernel - 1]`` (its previous inputs); returns SiLU of the output and the new state."""
    full = torch.cat((state, x.t()), dim=1)  # [channels, kernel - 1 + n]
    out = F.conv1d(full[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out.t()), full[:, full.shape[1] - state.shape[1] :]


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    every: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. Shapes as ``chunked``, or with a leading batch dimension on all of
    them (decode: one token of many sequences as ``[B, 1, heads, ...]``). ``every``: the
    state after each token is appended to it (a verify forward's per-position states)."""
    out = torch.empty_like(v)
    for t in range(q.shape[-3]):
        state = state * g[..., t, :].exp()[..., None, None]
        kt, qt = k[..., t, :, :], q[..., t, :, :]
        predicted = (state * kt[..., None]).sum(dim=-2)  # S^T k: [.., heads, dv]
        delta = (v[..., t, :, :] - predicted) * beta[..., t, :, None]
        state = state + kt[..., None] * delta[..., None, :]
        out[..., t, :, :] = (state * qt[..., None]).sum(dim=-2)
        if every is not None:
            every.append(state)
    return out, state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    start: int = 0,
    keep: Sequence[int] = (),
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence, ``chunk`` tokens at a time: ``q, k [n, h, dk]``, ``v [n, h, dv]``, ``g,
    beta [n, h]``, ``state [h, dk, dv]`` (after the ``start`` tokens before these) -> ``(out
    [n, h, dv], state, kept)``; ``kept``: the states after the first ``keep[i]`` of these
    tokens (ascending, inside the piece), each read off its chunk's corrections: one small
    matmul, no more chunks.

    Within a chunk with cumulative log decay ``c``, token i's correction depends on the earlier
    tokens' corrections through ``A[i, j] = beta_i (k_i . k_j) exp(c_i - c_j)`` (j < i); solving
    ``(I + A) U = beta V`` and ``(I + A) W = beta exp(c) K`` once gives every correction as
    ``U - W S`` for the state ``S`` entering the chunk.
    """
    n, front = q.shape[0], start % chunk
    back = -(front + n) % chunk
    # zero tokens (k = v = beta = g = 0) leave the state untouched; padding the front to the
    # sequence's own chunk grid (``start``: the position of the first token) groups tokens the
    # same way wherever the sequence was cut, so the float sums do not depend on the cut
    q, k, v, g, beta = (
        F.pad(t.transpose(0, 1).float(), (0, 0, front, back) if t.dim() == 3 else (front, back))
        for t in (q, k, v, g, beta)
    )
    h = q.shape[0]
    q, k, v = (t.reshape(h, -1, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(h, -1, chunk), beta.reshape(h, -1, chunk)
    c = g.cumsum(dim=-1)  # [h, chunks, chunk]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(later, float("-inf")).exp()
    kb = k * beta[..., None]
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, device=q.device)
    u = torch.linalg.solve_triangular(system + eye, v * beta[..., None], upper=False)
    w = torch.linalg.solve_triangular(system + eye, kb * c.exp()[..., None], upper=False)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_in = q * c.exp()[..., None]  # a query reads the entering state decayed to its position
    k_out = k * (c[..., -1:] - c).exp()[..., None]  # a key's write decayed to the chunk's end
    end = c[..., -1].exp()
    state = state.float()
    out = torch.empty_like(v)
    kept: list[torch.Tensor] = []
    at = [divmod(front + r, chunk) for r in keep]  # (chunk, tokens of it) each kept state is after
    for i in range(q.shape[1]):
        corrections = u[:, i] - w[:, i] @ state
        kept += [_within(state, k[:, i], c[:, i], corrections, j) for ci, j in at if ci == i]
        out[:, i] = q_in[:, i] @ state + scores[:, i] @ corrections
        state = state * end[:, i, None, None] + k_out[:, i].transpose(-1, -2) @ corrections
    return out.reshape(h, -1, out.shape[-1])[:, front : front + n].transpose(0, 1), state, kept


def _within(
    state: torch.Tensor, k: torch.Tensor, c: torch.Tensor, corrections: torch.Tensor, j: int
) -> torch.Tensor:
    """The state after the first ``j`` tokens of a chunk entered with ``state``: decayed to
    token ``j - 1``, plus their keys' corrections decayed to it (``j`` 0: ``state``)."""
    if j == 0:
        return state
    decay = (c[:, j - 1 : j] - c[:, :j]).exp()[..., None]  # [h, j, 1]
    written = (k[:, :j] * decay).transpose(-1, -2) @ corrections[:, :j]
    return state * c[:, j - 1].exp()[:, None, None] + written
