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

``log_decay`` (every causal form; optional (h,) tensor g_h ≤ 0): a per-head decay λ_h = exp(g_h) of
the linear weights (gated linear attention with a scalar gate per head, "Gated Linear Attention
Transformers with Hardware-Efficient Training"): key j's linear weight for query i becomes
λ_h^(i−j)·φq_i·φk_j, in numerator and normaliser alike; the state decays by λ_h every position
(S_t = λ S_{t−1} + φk_t v_tᵀ). A padded position advances time like any other, so a left-padded
row equals the unpadded one (weights depend on i − j only). Decays are exp(g·distance) with
distance ≥ 0 — never a division by a decay — so they underflow to 0, never overflow. None is no
decay (g = 0 gives the same numbers through the decayed path).
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


def _per_head(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-head (h,) tensor shaped to broadcast along dim 1 of a (b, h, …) tensor of ``ndim`` dims."""
    return x.float().view(1, -1, *([1] * (ndim - 2)))


def _decays(log_decay: torch.Tensor, dist: torch.Tensor, ndim: int, masked: bool = True) -> torch.Tensor:
    """exp(g_h·dist) where dist ≥ 0, else 0: shaped (1, h, …, *dist.shape) with ``ndim`` dims, to
    broadcast against a (b, h, …) tensor whose last dims are dist's. ``masked=False`` skips the
    zeros (dist ≥ 0 everywhere, or the caller masks: fewer ops)."""
    powers = torch.exp(_per_head(log_decay, ndim) * dist.clamp(min=0))
    return powers * (dist >= 0) if masked else powers


def linear_attention_quadratic(
    q, k, v, mask=None, *, causal: bool = True, eps: float = 1e-6, log_decay: torch.Tensor | None = None
):
    """Returns (out (b, h, l, d), weights (b, h, l, l)); weights rows sum to ~1 (0 at padding)."""
    dtype = v.dtype
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    scores = q @ k.transpose(-1, -2)  # (b, h, l, l)
    if causal:
        scores = scores.tril()
    if log_decay is not None:
        if not causal:
            raise ValueError("a decay (log_decay) needs the causal form")
        pos = torch.arange(q.shape[2], device=q.device)
        scores = scores * _decays(log_decay, pos[:, None] - pos[None, :], 4)
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


def _decayed_exclusive_cumsum(
    t: torch.Tensor, log_carry: torch.Tensor, shift: int = 1, loop: bool | None = None
) -> torch.Tensor:
    """Along dim 2 of t (b, h, n, …): out[n] = Σ_{m ≤ n − shift} exp(log_carry_h)^(n − shift − m)·t[m]
    (zeros for the first ``shift``) — chunk states decayed by a per-head factor per chunk. On a CPU
    (or ``loop``) one multiply-add per chunk in order; elsewhere one batched matmul with the (n × n)
    matrix of decay powers, each exp(g·distance) with distance ≥ 0 (no overflow, loop-free)."""
    n = t.shape[2]
    if loop if loop is not None else t.device.type == "cpu":
        parts, carry = t.unbind(2), torch.exp(_per_head(log_carry, t.dim() - 1))
        sums = [torch.zeros_like(parts[0])] * min(shift, n)
        for i in range(shift, n):
            sums.append(parts[i - shift] if i == shift else sums[-1] * carry + parts[i - shift])
        return torch.stack(sums, 2)
    idx = torch.arange(n, device=t.device)
    powers = _decays(log_carry, idx[:, None] - shift - idx[None, :], 4)[0]  # (h, n, n)
    return (powers @ t.flatten(3)).view_as(t)


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
    log_decay: torch.Tensor | None = None,
):
    """Causal form for training and prefill, loop-free: quadratic inside (C × C) chunks, every
    chunk's incoming state an exclusive cumulative sum of the chunks' φkᵀv before it (all chunks
    at once: a few large batched matmuls, not a loop of small ones). With ``log_decay`` every chunk's
    contribution is decayed to its end, and the cumulative sum decays by λ^C per chunk; fla's
    kernel has no decay here, so a decayed call runs this PyTorch form on every device.
    Returns (out (b, h, l, d), final state)."""
    if log_decay is None and resolve_backend(backend, q) == "fla":  # the kernels' dispatch (ops/kernels.py)
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
    # (b, h, n, c, ·); padded positions are zero: no key, no output
    qb, kb, vb = (_blocks(t, n, c) for t in (q, k, v))
    if log_decay is not None:
        return _decayed_chunks(qb, kb, vb, state, log_decay, l, eps, dtype)
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


def _decayed_chunks(qb, kb, vb, state: LinearAttentionState, log_decay, l: int, eps: float, dtype):
    """``linear_attention_chunked``'s decayed form, from its (b, h, n, c, ·) chunks: a chunk's
    incoming state is the one before it decayed by λ^c plus its contribution decayed to its last
    token; query t of a chunk reads it decayed by λ^(t+1). (Decays scale the d-wide values and
    outputs, not the wider features: fewer passes over memory.)"""
    n, c = qb.shape[2], qb.shape[3]
    t = torch.arange(c, device=qb.device)
    intra = (qb @ kb.transpose(-1, -2)) * _decays(log_decay, t[:, None] - t[None, :], 5)  # causal, decayed
    to_end = _decays(log_decay, c - 1 - t, 4, masked=False)[..., None]  # (1, h, 1, c, 1)
    chunk_kv = kb.transpose(-1, -2) @ (vb * to_end)  # (b, h, n, f, d)
    chunk_k = (to_end.transpose(-1, -2) @ kb).squeeze(-2)  # (b, h, n, f)
    # λ^(c·n): the carried state
    starts = _decays(log_decay, c * torch.arange(n, device=qb.device), 3, masked=False)
    kv_in = state.kv[:, :, None] * starts[..., None, None] + _decayed_exclusive_cumsum(
        chunk_kv, c * log_decay
    )
    k_in = state.k_sum[:, :, None] * starts[..., None] + _decayed_exclusive_cumsum(chunk_k, c * log_decay)
    reads = _decays(log_decay, t + 1, 4, masked=False)[..., None]  # (1, h, 1, c, 1)
    num = intra @ vb + (qb @ kv_in) * reads
    den = intra.sum(-1) + (qb @ k_in[..., None]).squeeze(-1) * reads[..., 0]
    out = (num / (den[..., None] + eps)).flatten(2, 3)[:, :, :l]
    r = l - (n - 1) * c  # the last chunk's real length: the final state is at its token r − 1
    last = _decays(log_decay, r - 1 - t, 3)[..., None]  # (1, h, c, 1)
    carry = _decays(log_decay, torch.tensor(r, device=qb.device), 3, masked=False)  # (1, h, 1)
    final = LinearAttentionState(
        kv_in[:, :, -1] * carry[..., None] + kb[:, :, -1].transpose(-1, -2) @ (vb[:, :, -1] * last),
        k_in[:, :, -1] * carry + (kb[:, :, -1] * last).sum(2),
    )
    return out.to(dtype), final


def linear_attention_step(
    q,
    k,
    v,
    state: LinearAttentionState,
    *,
    eps: float = 1e-6,
    inplace: bool = False,
    log_decay: torch.Tensor | None = None,
):
    """One decode step: q, k (b, h, f), v (b, h, d). Returns (out (b, h, d) in v's dtype, new
    state). In the fewest ops (decode speed): the state update is one batched rank-1 update, the
    numerator and denominator one batched matmul each. ``inplace``: the new state is written into
    ``state``'s tensors (no allocation; a decode step's cache owns them), else the old state is kept.
    ``log_decay`` (h,): the state first decays by λ_h = exp(g_h)."""
    dtype = v.dtype
    q, k, v = q.float(), k.float(), v.float()
    b, h, f = q.shape
    d = v.shape[-1]
    k_col, v_row = k.reshape(b * h, f, 1), v.reshape(b * h, 1, d)
    old_kv, old_k = state.kv, state.k_sum
    if log_decay is not None:
        lam = torch.exp(_per_head(log_decay, 3))  # (1, h, 1)
        old_kv, old_k = (
            (old_kv.mul_(lam[..., None]), old_k.mul_(lam))
            if inplace
            else (old_kv * lam[..., None], old_k * lam)
        )
    if inplace:
        kv = old_kv.view(b * h, f, d).baddbmm_(k_col, v_row)
        k_sum = old_k.add_(k)
    else:
        kv = torch.baddbmm(old_kv.reshape(b * h, f, d), k_col, v_row)
        k_sum = old_k + k
    qf = q.reshape(b * h, 1, f)
    num = torch.bmm(qf, kv)  # (b·h, 1, d)
    den = torch.bmm(qf, k_sum.reshape(b * h, f, 1))  # (b·h, 1, 1)
    out = num.div_(den.add_(eps)).view(b, h, d)
    return (out if dtype == torch.float32 else out.to(dtype)), (
        state if inplace else LinearAttentionState(kv.view(b, h, f, d), k_sum)
    )


def linear_attention_sequential(
    q,
    k,
    v,
    mask=None,
    state: LinearAttentionState | None = None,
    *,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
):
    """Token-by-token loop over ``linear_attention_step`` — the reference the others are tested against."""
    b, h, l, f = q.shape
    q, k, v = _apply_mask(q.float(), k.float(), v.float(), mask)
    if state is None:
        state = LinearAttentionState.zeros(b, h, f, v.shape[-1], device=q.device)
    outs = []
    for t in range(l):
        o, state = linear_attention_step(
            q[:, :, t], k[:, :, t], v[:, :, t], state, eps=eps, log_decay=log_decay
        )
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

    kv, k_sum: linear sums over tokens that have left the window (with a decay: each decayed to the
    last token seen); keys/values/fkeys: the last ``window − 1`` tokens (raw post-RoPE keys for the
    softmax part, their features for when they leave); valid: (b, w') 1 where a cached token is real
    (left padding stays excluded).
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


def _window_weights(q, keys, fq, fkeys, dist, key_ok, *, scaling, window, gamma, log_decay):
    """Unnormalised weights of queries (…, l, ·) against keys (…, L, ·) at distances ``dist`` (l, L):
    γ_h·exp(s − m) where 0 ≤ dist < window (m the row's max over its window), φq·φk·λ_h^dist where
    dist ≥ window; ``key_ok`` (broadcast to the weights) marks real keys."""
    in_window = (dist >= 0) & (dist < window) & key_ok
    outside = (dist >= window) & key_ok
    soft = _window_softmax_terms(q, keys, in_window, scaling, gamma)
    lin = (fq @ fkeys.transpose(-1, -2)) * outside
    if log_decay is not None:
        lin = lin * _decays(log_decay, dist, lin.dim(), masked=False)
    return soft + lin


def _window_softmax_terms(q, keys, in_window, scaling, gamma):
    """γ_h·exp(s − m) where ``in_window`` (m the row's max there), 0 elsewhere; a row with no key in
    its window is all 0."""
    scores = ((q @ keys.transpose(-1, -2)) * scaling).masked_fill(~in_window, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    return torch.exp(scores - row_max) * _per_head(gamma, scores.dim())


def _normalised(weights, values, fq, kv, k_sum, eps, reads=None):
    """(Σ weights·v + r·φq·S) / (Σ weights + r·φq·z) and the denominator; ``reads`` (broadcast to
    (…, l, 1)) r: the decay from the state (S, z) to each query, None for 1. A row with no visible
    key (padding) is 0."""
    state_num, state_den = fq @ kv, (fq @ k_sum[..., None]).squeeze(-1)
    if reads is not None:
        state_num, state_den = state_num * reads, state_den * reads[..., 0]
    num = weights @ values + state_num
    den = weights.sum(-1) + state_den
    den = torch.where(den > 0, den, torch.ones_like(den))  # rows with no visible key (padding): 0, not 0/0
    return num / (den[..., None] + eps), den


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
    log_decay: torch.Tensor | None = None,
):
    """One block of queries against [cached window; block] keys plus the linear state.

    Weight of key j for query i (unnormalised): γ_h·exp(s_ij − m_i) if i − j < window (s = q·k·scaling,
    m_i the row's max over its window), else φq_i·φk_j (times λ_h^(i−j) with ``log_decay``); rows are
    normalised by their sum. q, k, v: (b, h, l, d) post-RoPE; fq, fk: (b, h, l, f); gamma: (h,) in
    (0, 1). Feeding a sequence in blocks with the returned state equals one block over the whole
    sequence (tested); a block of one token is the decode step. Returns (out (b, h, l, d), state[,
    weights (b, h, l, w'+l) over the cached and the block's keys]).
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
    pos = torch.arange(total, device=q.device)
    dist = pos[cached:, None] - pos[None, :]  # (l, L)
    weights = _window_weights(
        q,
        keys,
        fq,
        fkeys,
        dist,
        valid[:, None, None, :] > 0,
        scaling=scaling,
        window=window,
        gamma=gamma,
        log_decay=log_decay,
    )
    # the state sums keys up to the token before this block: query i reads it decayed by λ^(i+1)
    reads = None if log_decay is None else _decays(log_decay, pos[:l, None] + 1, 4, masked=False)
    out, den = _normalised(weights, values, fq, state.kv, state.k_sum, eps, reads)
    out = out * m[:, None, :, None]
    new_state = _slide_window(state, keys, values, fkeys, valid, window, l, log_decay)
    if return_weights:
        return out.to(dtype), new_state, weights / (den[..., None] + eps)
    return out.to(dtype), new_state


def window_linear_attention_step(
    q,
    k,
    v,
    fq,
    fk,
    state: WindowState,
    *,
    scaling: float,
    window: int,
    gamma: torch.Tensor,
    mask=None,
    eps: float = 1e-6,
    log_decay: torch.Tensor | None = None,
):
    """One decode token against a full window: q, k, v (b, h, d) post-RoPE, fq, fk (b, h, f), a
    ``state`` caching ``window − 1`` tokens, ``mask`` (b,) or None. Every cached key lies inside the
    token's window, so the weights are the window's softmax terms alone and the older keys are read
    through the linear sums (decayed once more, by λ) — ``window_linear_attention`` over a block of
    one token without the linear weights it would mask out, and with static shapes a trace can
    compile (tested equal). Returns (out (b, h, d) in v's dtype, new state)."""
    if state.keys.shape[2] != max(window - 1, 0):
        raise ValueError(
            f"the window step needs {max(window - 1, 0)} cached tokens, the state holds {state.keys.shape[2]}"
        )
    dtype = v.dtype
    b, h, _ = q.shape
    q, k, v, fq, fk = (t.float()[:, :, None] for t in (q, k, v, fq, fk))  # (b, h, 1, ·)
    m = torch.ones(b, 1, device=q.device) if mask is None else mask.float().view(b, 1)
    mh = m[:, None, :, None]
    keys = torch.cat([state.keys, k], 2)
    values = torch.cat([state.values, v * mh], 2)
    fkeys = torch.cat([state.fkeys, fk * mh], 2)
    valid = torch.cat([state.valid, m], 1)  # (b, window)
    soft = _window_softmax_terms(q, keys, valid[:, None, None, :] > 0, scaling, gamma)
    reads = None if log_decay is None else torch.exp(_per_head(log_decay, 4))  # λ: one step since the sums
    out, _ = _normalised(soft, values, fq, state.kv, state.k_sum, eps, reads)
    new_state = _slide_window(state, keys, values, fkeys, valid, window, 1, log_decay)
    return (out * mh)[:, :, 0].to(dtype), new_state


def _slide_window(state: WindowState, keys, values, fkeys, valid, window: int, l: int, log_decay):
    """The state after a block of ``l`` tokens: the tokens that no query from now on sees through
    the window (all but the last window − 1 of [cache; block]) join the linear sums — decayed to
    the block's last token, as the sums already there are by λ^l."""
    leave = max(keys.shape[2] - max(window - 1, 0), 0)
    fk_out, v_out = fkeys[:, :, :leave], values[:, :, :leave]
    kv, k_sum = state.kv, state.k_sum
    if log_decay is not None:
        age = keys.shape[2] - 1 - torch.arange(leave, device=keys.device)  # distance to the last token
        fk_out = fk_out * _decays(log_decay, age, 3, masked=False)[..., None]
        carry = _decays(log_decay, torch.tensor(l, device=keys.device), 3, masked=False)  # (1, h, 1)
        kv, k_sum = kv * carry[..., None], k_sum * carry
    return WindowState(
        kv + fk_out.transpose(-1, -2) @ v_out,
        k_sum + fk_out.sum(2),
        *_window_cache(keys, values, fkeys, valid, leave),
    )


def _window_cache(keys, values, fkeys, valid, leave: int) -> tuple:
    """The tokens after the first ``leave``, copied with standard strides (``contiguous`` keeps a
    view's strides where a dim has size 1): a state always has the same strides, which a compiled
    decode step's static shapes need (else it would trace again)."""
    fresh = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731
    return tuple(fresh(t[:, :, leave:]) for t in (keys, values, fkeys)) + (fresh(valid[:, leave:]),)


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
    log_decay: torch.Tensor | None = None,
):
    """``window_linear_attention`` over a whole sequence from an empty state, loop-free.

    With chunks of C ≥ window tokens, a query's softmax window lies in its own chunk and the one
    before, so every chunk is scored at once against a 2C-key strip (previous chunk + its own):
    exact softmax weights where 0 ≤ i − j < window, linear weights φq·φk for the strip's older keys,
    and the linear state of every key before the previous chunk as an exclusive cumulative sum of
    the chunks' φkᵀv (shifted by two chunks; with ``log_decay`` a decayed one, read by query t of a
    chunk decayed by λ^(C+t+1)). The row max m_i is the same window max the block form takes.
    Returns (out (b, h, l, d), the block form's final ``WindowState`` if ``return_state`` else None).
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
    t = torch.arange(2 * c, device=q.device)
    dist = t[c:, None] - t[None, :]  # (c, 2c)
    opts = dict(scaling=scaling, window=window, gamma=gamma, log_decay=log_decay)
    weights = _window_weights(qb, keys, fqb, fkeys, dist, key_ok, **opts)  # (b, h, n, c, 2c)
    older_kv, older_k = _older_states(fkb, vb, log_decay)
    reads = None if log_decay is None else _decays(log_decay, t[c:] + 1, 4, masked=False)[..., None]
    out, _ = _normalised(weights, values, fqb, older_kv, older_k, eps, reads)
    out = out.flatten(2, 3)[:, :, :l] * mh
    state = _prefill_window_state(k, v, fk, m, window, log_decay) if return_state else None
    return out.to(dtype), state


def _prefill_window_state(k, v, fk, m, window: int, log_decay) -> WindowState:
    """The state the block form leaves after a whole sequence (values and features of padded tokens
    already zero): the last window − 1 tokens cached, the rest in the linear sums (each decayed to
    the last token with ``log_decay``)."""
    l = k.shape[2]
    leave = max(l - max(window - 1, 0), 0)
    fk_, v_ = fk[:, :, :leave], v[:, :, :leave]
    if log_decay is not None:
        fk_ = (
            fk_ * _decays(log_decay, l - 1 - torch.arange(leave, device=k.device), 3, masked=False)[..., None]
        )
    return WindowState(fk_.transpose(-1, -2) @ v_, fk_.sum(2), *_window_cache(k, v, fk, m, leave))


def _older_states(fkb, vb, log_decay):
    """Per chunk of (b, h, n, c, ·) keys/values, the linear sums (S, z) of every key before the
    chunk before it: an exclusive cumulative sum shifted by two chunks; with ``log_decay`` each
    chunk's keys decayed to its last token and the sum decayed by λ^c per chunk (so S is at the
    last token of chunk n − 2)."""
    if log_decay is None:
        chunk_kv = fkb.transpose(-1, -2) @ vb  # (b, h, n, f, d)
        return _exclusive_cumsum(chunk_kv, 2, shift=2), _exclusive_cumsum(fkb.sum(3), 2, shift=2)
    c = fkb.shape[3]
    to_end = _decays(log_decay, c - 1 - torch.arange(c, device=fkb.device), 4, masked=False)[
        ..., None
    ]  # (1, h, 1, c, 1)
    chunk_kv = fkb.transpose(-1, -2) @ (vb * to_end)  # the d-wide values scaled, not the features
    chunk_k = (to_end.transpose(-1, -2) @ fkb).squeeze(-2)
    return (
        _decayed_exclusive_cumsum(chunk_kv, c * log_decay, shift=2),
        _decayed_exclusive_cumsum(chunk_k, c * log_decay, shift=2),
    )
