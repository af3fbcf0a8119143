"""Normalised linear attention, y_i = Σ_j A_ij v_j with A_ij = φq_i·φk_j / Σ_m φq_i·φk_m.

Inputs are already feature-mapped: ``q, k`` are (b, h, l, f) and non-negative, ``v`` is
(b, h, l, d). Three forms that tests hold equal (fp32, 1e-5):

* ``*_quadratic`` materialises the (l × l) weights — for distillation losses and plots;
* ``*_chunked`` runs quadratic inside chunks, each chunk's incoming state (S, z) a cumulative
  sum over the chunks before it, all chunks at once — training and prefill, O(l·C·f + l·f·d);
* ``*_step`` consumes one token against the state — decode, O(f·d) per token.

``mask`` is an optional (b, l) padding mask (1 = real token). A padded token is neither a
key nor a query: it adds nothing to the state and its output is zero. All math runs in
float32; outputs return in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn2ssm.ops.kernels import resolve_backend
from attn2ssm.ops.linear_state import LinearAttentionState


def _apply_mask(q, k, v, mask):
    if mask is None:
        return q, k, v
    m = mask[:, None, :, None].to(q.dtype)  # (b, 1, l, 1)
    return q * m, k * m, v * m


def linear_attention_quadratic(q, k, v, mask=None, *, causal: bool = True, eps: float = 1e-6):
    """Returns (out (b, h, l, d), weights (b, h, l, l)); weights rows sum to ~1 (0 at padding)."""
    dtype = v.dtype
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    scores = q @ k.transpose(-1, -2)  # (b, h, l, l)
    if causal:
        scores = scores.tril()
    weights = scores / (scores.sum(-1, keepdim=True) + eps)
    return (weights @ v).to(dtype), weights


def _blocks(t: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    """(b, h, l, x) → (b, h, n, chunk, x), zero-padded at the end to n·chunk positions."""
    pad = n * chunk - t.shape[2]
    if pad:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
    return t.unflatten(2, (n, chunk))


def _exclusive_cumsum(t: torch.Tensor, dim: int, shift: int = 1) -> torch.Tensor:
    """Sums of the entries ``shift`` or more places before each one along ``dim`` (zeros for the first ``shift``)."""
    if t.device.type == "cpu":
        # On a CPU, torch.cumsum along a middle dim of a (b, h, n, f, d) state runs ~10x slower
        # (forward + backward) than adding the n slices in order: one add per chunk, no per-chunk math.
        parts = t.unbind(dim)
        sums = [torch.zeros_like(parts[0])] * min(shift, len(parts))
        for i in range(shift, len(parts)):
            sums.append(parts[i - shift] if i == shift else sums[-1] + parts[i - shift])
        return torch.stack(sums, dim)
    total = t.cumsum(dim)
    pad = torch.zeros_like(total.narrow(dim, 0, min(shift, total.shape[dim])))
    return torch.cat([pad, total.narrow(dim, 0, max(total.shape[dim] - shift, 0))], dim)


def linear_attention_chunked(
    q,
    k,
    v,
    mask=None,
    state: LinearAttentionState | None = None,
    *,
    chunk_size: int = 64,
    eps: float = 1e-6,
    backend: str = "torch",
):
    """Causal form for training and prefill, loop-free: quadratic inside (C × C) chunks, every
    chunk's incoming state an exclusive cumulative sum of the chunks' φkᵀv before it (all chunks
    at once: a few large batched matmuls, not a loop of small ones). Returns (out (b, h, l, d), final state)."""
    if resolve_backend(backend, q) == "fla":  # the kernels' dispatch (ops/kernels.py)
        from attn2ssm.ops.fla import linear_attention_fla  # optional: attn2ssm[gpu]

        return linear_attention_fla(q, k, v, mask, state, eps=eps)
    dtype = v.dtype
    b, h, l, f = q.shape
    d = v.shape[-1]
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    if state is None:
        state = LinearAttentionState.zeros(b, h, f, d, device=q.device)
    if l == 0:
        return v.new_zeros(b, h, 0, d).to(dtype), state
    c = min(chunk_size, l)
    n = -(-l // c)
    qb, kb, vb = (
        _blocks(t, n, c) for t in (q, k, v)
    )  # (b, h, n, c, ·); padded positions are zero: no key, no output
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    intra = (qb @ kb.transpose(-1, -2)).masked_fill(~causal, 0.0)  # (b, h, n, c, c)
    chunk_kv = kb.transpose(-1, -2) @ vb  # (b, h, n, f, d)
    chunk_k = kb.sum(3)  # (b, h, n, f)
    kv_in = state.kv[:, :, None] + _exclusive_cumsum(chunk_kv, 2)  # the state each chunk starts from
    k_in = state.k_sum[:, :, None] + _exclusive_cumsum(chunk_k, 2)
    num = intra @ vb + qb @ kv_in  # (b, h, n, c, d)
    den = intra.sum(-1) + (qb @ k_in[..., None]).squeeze(-1)
    out = (num / (den[..., None] + eps)).flatten(2, 3)[:, :, :l]
    final = LinearAttentionState(state.kv + chunk_kv.sum(2), state.k_sum + chunk_k.sum(2))
    return out.to(dtype), final


def linear_attention_step(q, k, v, state: LinearAttentionState, *, eps: float = 1e-6, inplace: bool = False):
    """One decode step: q, k (b, h, f), v (b, h, d). Returns (out (b, h, d) in v's dtype, new
    state). In the fewest ops (decode speed): the state update is one batched rank-1 update, the
    numerator and denominator one batched matmul each. ``inplace``: the new state is written into
    ``state``'s tensors (no allocation; a decode step's cache owns them), else the old state is kept."""
    dtype = v.dtype
    q, k, v = q.float(), k.float(), v.float()
    b, h, f = q.shape
    d = v.shape[-1]
    k_col, v_row = k.reshape(b * h, f, 1), v.reshape(b * h, 1, d)
    if inplace:
        kv = state.kv.view(b * h, f, d).baddbmm_(k_col, v_row)
        k_sum = state.k_sum.add_(k)
    else:
        kv = torch.baddbmm(state.kv.reshape(b * h, f, d), k_col, v_row)
        k_sum = state.k_sum + k
    qf = q.reshape(b * h, 1, f)
    num = torch.bmm(qf, kv)  # (b·h, 1, d)
    den = torch.bmm(qf, k_sum.reshape(b * h, f, 1))  # (b·h, 1, 1)
    out = num.div_(den.add_(eps)).view(b, h, d)
    return (out if dtype == torch.float32 else out.to(dtype)), (
        state if inplace else LinearAttentionState(kv.view(b, h, f, d), k_sum)
    )


def linear_attention_sequential(
    q, k, v, mask=None, state: LinearAttentionState | None = None, *, eps: float = 1e-6
):
    """Token-by-token loop over ``linear_attention_step`` — the reference the others are tested against."""
    b, h, l, f = q.shape
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    if state is None:
        state = LinearAttentionState.zeros(b, h, f, v.shape[-1], device=q.device)
    outs = []
    for t in range(l):
        o, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, eps=eps)
        outs.append(o)
    return torch.stack(outs, dim=2), state


def linear_attention_noncausal(q, k, v, mask=None, *, eps: float = 1e-6):
    """Bidirectional form: every query sees every (real) key; O(l·f·d)."""
    dtype = v.dtype
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    kv = k.transpose(-1, -2) @ v  # (b, h, f, d)
    den = q @ k.sum(2)[..., None]  # (b, h, l, 1)
    return ((q @ kv) / (den + eps)).to(dtype)


# ---------------------------------------------------------------------------------------------
# Linear attention + a sliding window of exact softmax attention (LoLCATs-style)


@dataclass
class WindowState:
    """Decode state of window + linear attention.

    kv, k_sum: linear sums over tokens that have left the window; keys/values/fkeys: the last
    ``window − 1`` tokens (raw post-RoPE keys for the softmax part, their features for when they
    leave); valid: (b, w') 1 where a cached token is real (left padding stays excluded).
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    fkeys: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def empty(cls, b, h, d, f, device=None) -> "WindowState":
        z = lambda *s: torch.zeros(*s, device=device, dtype=torch.float32)  # noqa: E731
        return cls(z(b, h, f, d), z(b, h, f), z(b, h, 0, d), z(b, h, 0, d), z(b, h, 0, f), z(b, 0))


def window_linear_attention(
    q,
    k,
    v,
    fq,
    fk,
    *,
    scaling: float,
    window: int,
    gamma: torch.Tensor,
    mask=None,
    state: WindowState | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """One block of queries against [cached window; block] keys plus the linear state.

    Weight of key j for query i (unnormalised): γ_h·exp(s_ij − m_i) if i − j < window (s = q·k·scaling,
    m_i the row's max over its window), else φq_i·φk_j; rows are normalised by their sum. q, k, v:
    (b, h, l, d) post-RoPE; fq, fk: (b, h, l, f); gamma: (h,) in (0, 1). Feeding a sequence in
    blocks with the returned state equals one block over the whole sequence (tested); a block of
    one token is the decode step. Returns (out (b, h, l, d), state[, weights (b, h, l, w'+l)]).
    """
    dtype = v.dtype
    b, h, l, d = q.shape
    q, k, v, fq, fk = (t.float() for t in (q, k, v, fq, fk))
    m = torch.ones(b, l, device=q.device) if mask is None else mask.float()
    if state is None:
        state = WindowState.empty(b, h, d, fq.shape[-1], device=q.device)
    keys = torch.cat([state.keys, k], 2)
    values = torch.cat([state.values, v * m[:, None, :, None]], 2)
    fkeys = torch.cat([state.fkeys, fk * m[:, None, :, None]], 2)
    valid = torch.cat([state.valid, m], 1)  # (b, L)
    cached, total = state.keys.shape[2], keys.shape[2]
    dist = (torch.arange(l, device=q.device) + cached)[:, None] - torch.arange(total, device=q.device)[
        None, :
    ]
    key_ok = valid[:, None, None, :] > 0  # (b, 1, 1, L)
    in_window = (dist >= 0) & (dist < window) & key_ok
    outside = (dist >= window) & key_ok
    scores = (q @ keys.transpose(-1, -2)) * scaling  # (b, h, l, L)
    scores = scores.masked_fill(~in_window, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    soft = torch.exp(scores - row_max) * gamma.float()[None, :, None, None]
    lin = (fq @ fkeys.transpose(-1, -2)) * outside
    weights = soft + lin
    num = weights @ values + fq @ state.kv
    den = weights.sum(-1) + (fq @ state.k_sum[..., None]).squeeze(-1)
    den = torch.where(den > 0, den, torch.ones_like(den))  # rows with no visible key (padding): 0, not 0/0
    out = (num / (den[..., None] + eps)) * m[:, None, :, None]
    # tokens that no query from now on sees through the window join the linear state
    keep = max(window - 1, 0)
    leave = max(total - keep, 0)
    kv = state.kv + fkeys[:, :, :leave].transpose(-1, -2) @ values[:, :, :leave]
    k_sum = state.k_sum + fkeys[:, :, :leave].sum(2)
    new_state = WindowState(
        kv, k_sum, keys[:, :, leave:], values[:, :, leave:], fkeys[:, :, leave:], valid[:, leave:]
    )
    if return_weights:
        return out.to(dtype), new_state, weights / (den[..., None] + eps)
    return out.to(dtype), new_state


def window_linear_attention_chunked(
    q,
    k,
    v,
    fq,
    fk,
    *,
    scaling: float,
    window: int,
    gamma: torch.Tensor,
    mask=None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    return_state: bool = False,
):
    """``window_linear_attention`` over a whole sequence from an empty state, loop-free.

    With chunks of C ≥ window tokens, a query's softmax window lies in its own chunk and the one
    before, so every chunk is scored at once against a 2C-key strip (previous chunk + its own):
    exact softmax weights where 0 ≤ i − j < window, linear weights φq·φk for the strip's older keys,
    and the linear state of every key before the previous chunk as an exclusive cumulative sum of
    the chunks' φkᵀv (shifted by two chunks). The row max m_i is the same window max the block form
    takes. Returns (out (b, h, l, d), the block form's final ``WindowState`` if ``return_state`` else None).
    """
    dtype = v.dtype
    b, h, l, d = q.shape
    q, k, v, fq, fk = (t.float() for t in (q, k, v, fq, fk))
    m = torch.ones(b, l, device=q.device) if mask is None else mask.float()
    c = max(chunk_size, window, 1)
    n = max(-(-l // c), 1)
    mh = m[:, None, :, None]
    v, fk = v * mh, fk * mh  # a padded token is no key: zero value and features (its score is masked below)
    qb, kb, vb, fqb, fkb = (_blocks(t, n, c) for t in (q, k, v, fq, fk))  # (b, h, n, c, ·)
    valid = _blocks(m[:, None, :, None], n, c)[..., 0] > 0  # (b, 1, n, c); end padding is invalid
    prev = lambda t: torch.cat([torch.zeros_like(t[:, :, :1]), t[:, :, :-1]], 2)  # noqa: E731  (the chunk before; none for the first)
    keys, values, fkeys = (torch.cat([prev(t), t], 3) for t in (kb, vb, fkb))  # (b, h, n, 2c, ·)
    key_ok = torch.cat([prev(valid), valid], 3)[:, :, :, None, :]  # (b, 1, n, 1, 2c)
    dist = (torch.arange(c, device=q.device) + c)[:, None] - torch.arange(2 * c, device=q.device)[
        None, :
    ]  # (c, 2c)
    in_window = (dist >= 0) & (dist < window) & key_ok
    outside = (dist >= window) & key_ok
    scores = ((qb @ keys.transpose(-1, -2)) * scaling).masked_fill(
        ~in_window, float("-inf")
    )  # (b, h, n, c, 2c)
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = (
        torch.exp(scores - row_max) * gamma.float()[None, :, None, None, None]
        + (fqb @ fkeys.transpose(-1, -2)) * outside
    )
    chunk_kv = fkb.transpose(-1, -2) @ vb  # (b, h, n, f, d)
    chunk_k = fkb.sum(3)
    older_kv, older_k = (
        _exclusive_cumsum(chunk_kv, 2, shift=2),
        _exclusive_cumsum(chunk_k, 2, shift=2),
    )  # keys before the previous chunk
    num = weights @ values + fqb @ older_kv
    den = weights.sum(-1) + (fqb @ older_k[..., None]).squeeze(-1)
    den = torch.where(den > 0, den, torch.ones_like(den))  # rows with no visible key (padding): 0, not 0/0
    out = (num / (den[..., None] + eps)).flatten(2, 3)[:, :, :l] * mh
    state = None
    if return_state:  # as the block form leaves it: the last window − 1 tokens cached, the rest in the sums
        leave = max(l - max(window - 1, 0), 0)
        v_, fk_ = v[:, :, :leave], fk[:, :, :leave]
        state = WindowState(
            fk_.transpose(-1, -2) @ v_,
            fk_.sum(2),
            k[:, :, leave:],
            v[:, :, leave:],
            fk[:, :, leave:],
            m[:, leave:],
        )
    return out.to(dtype), state
