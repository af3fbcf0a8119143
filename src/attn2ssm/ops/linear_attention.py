"""Normalised linear attention, y_i = Σ_j A_ij v_j with A_ij = φq_i·φk_j / Σ_m φq_i·φk_m.

Inputs are already feature-mapped: ``q, k`` are (b, h, l, f) and non-negative, ``v`` is
(b, h, l, d). Three forms that tests hold equal (fp32, 1e-5):

* ``*_quadratic`` materialises the (l × l) weights — for distillation losses and plots;
* ``*_chunked`` runs quadratic inside chunks and carries the state (S, z) across them —
  training and prefill, O(l·C·f + l·f·d);
* ``*_step`` consumes one token against the state — decode, O(f·d) per token.

``mask`` is an optional (b, l) padding mask (1 = real token). A padded token is neither a
key nor a query: it adds nothing to the state and its output is zero. All math runs in
float32; outputs return in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LinearAttentionState:
    """Running sums of one causal linear-attention layer.

    kv: (b, h, f, d) = Σ φ(k_s) v_sᵀ    k_sum: (b, h, f) = Σ φ(k_s)
    """

    kv: torch.Tensor
    k_sum: torch.Tensor

    @classmethod
    def zeros(cls, b: int, h: int, f: int, d: int, device=None) -> "LinearAttentionState":
        return cls(
            torch.zeros(b, h, f, d, device=device, dtype=torch.float32),
            torch.zeros(b, h, f, device=device, dtype=torch.float32),
        )


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


def linear_attention_chunked(
    q, k, v, mask=None, state: LinearAttentionState | None = None, *, chunk_size: int = 64, eps: float = 1e-6
):
    """Causal form for training and prefill. Returns (out (b, h, l, d), final state)."""
    dtype = v.dtype
    b, h, l, f = q.shape
    d = v.shape[-1]
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    if state is None:
        state = LinearAttentionState.zeros(b, h, f, d, device=q.device)
    kv, k_sum = state.kv, state.k_sum
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    outs = []
    # torch.split, not slicing in the loop: the backward of each slice would materialise a
    # full-length zero gradient (O(l²/C) work); split's backward is one concatenation.
    for qc, kc, vc in zip(*(t.split(chunk_size, dim=2) for t in (q, k, v))):
        c = qc.shape[2]
        intra = (qc @ kc.transpose(-1, -2)).masked_fill(~causal[:c, :c], 0.0)  # (b, h, c, c)
        num = intra @ vc + qc @ kv  # (b, h, c, d)
        den = intra.sum(-1) + (qc @ k_sum[..., None]).squeeze(-1)  # (b, h, c); a matmul, not a (c × f) temporary
        outs.append(num / (den[..., None] + eps))
        kv = kv + kc.transpose(-1, -2) @ vc
        k_sum = k_sum + kc.sum(2)
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(b, h, 0, d)
    return out.to(dtype), LinearAttentionState(kv, k_sum)


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
    return (out if dtype == torch.float32 else out.to(dtype)), (state if inplace else LinearAttentionState(kv.view(b, h, f, d), k_sum))


def linear_attention_recurrent(q, k, v, mask=None, state: LinearAttentionState | None = None, *, eps: float = 1e-6):
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


def window_linear_attention(q, k, v, fq, fk, *, scaling: float, window: int, gamma: torch.Tensor, mask=None, state: WindowState | None = None, eps: float = 1e-6, return_weights: bool = False):
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
    dist = (torch.arange(l, device=q.device) + cached)[:, None] - torch.arange(total, device=q.device)[None, :]
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
    new_state = WindowState(kv, k_sum, keys[:, :, leave:], values[:, :, leave:], fkeys[:, :, leave:], valid[:, leave:])
    if return_weights:
        return out.to(dtype), new_state, weights / (den[..., None] + eps)
    return out.to(dtype), new_state
