"""The gated delta rule (Gated DeltaNet): a linear recurrence that *replaces* what a key stores.

Per head, with the state H (d_k × d_v) — the transpose of the paper's S, fla's layout [K, V]:

    H_t = α_t H_{t-1} + k_t u_tᵀ,   u_t = β_t (v_t − α_t H_{t-1}ᵀ k_t),   o_t = scale · H_tᵀ q_t

i.e. S_t = S_{t-1} α_t (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ: decay the state, read what it holds under
k_t, and move that a step β_t ∈ (0, 1) towards v_t. α_t = exp(g_t) with g_t ≤ 0 (a data-dependent
decay); q and k are expected L2-normalised (the mixer does it), so the update is a contraction.

Unrolled over a block with the decays γ_t = exp(g_1 + … + g_t) and Γ_ts = γ_t / γ_s (t ≥ s):

    (I + L) U = diag(β) V − diag(β γ) K H_0,   L = strictly-lower(diag(β) (Γ ⊙ K Kᵀ))
    O = scale · (diag(γ) Q H_0 + tril(Γ ⊙ Q Kᵀ) U),   H_end = γ_end H_0 + Kᵀ diag(γ_end / γ) U

(the WY / UT form of "Parallelizing Linear Transformers with the Delta Rule over Sequence Length"
and Gated DeltaNet): one triangular solve per block, everything else matrix products. Forms that
tests hold equal (fp32, 1e-5):

* ``gated_delta_quadratic`` — one block over the whole sequence; with ``return_matrix`` the
  materialised (b, h, l, l) map from v to o (no initial state) — for distillation losses and plots;
* ``gated_delta_chunked`` — blocks of ``chunk_size`` tokens, loop-free inside a block, the state
  carried across blocks — training and prefill;
* ``gated_delta_step`` — one token against the state — decode;
* ``gated_delta_sequential`` — the per-token loop over ``gated_delta_step``, the plain reference.

Shapes (fla's layout): q, k (b, l, h, d_k), v (b, l, h, d_v), g, beta (b, l, h), state
(b, h, d_k, d_v) float32. ``mask`` (b, l): 1 = real token; a padded token leaves the state as it
was (α = 1, β = 0, k = 0) and its output is 0. Math in float32; outputs in v's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.ops.kernels import needs_backward, resolve_backend
from attn2ssm.ops.ssd import segsum


def _prepare(q, k, v, g, beta, mask):
    """fp32 copies with padded tokens neutralised (decay 1, no write, no key)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if mask is None:
        return q, k, v, g, beta, None
    m = mask.to(device=q.device, dtype=torch.float32)
    return q * m[..., None, None], k * m[..., None, None], v, g * m[..., None], beta * m[..., None], m


def _scale(scale: float | None, d_k: int) -> float:
    return d_k**-0.5 if scale is None else scale


def _block(q, k, v, g, beta, h0, scale: float, want_matrix: bool = False):
    """One block, every token at once: q, k (b, h, c, d_k), v (b, h, c, d_v), g, beta (b, h, c),
    h0 (b, h, d_k, d_v). Returns (o (b, h, c, d_v), H_end[, the (b, h, c, c) map v → o])."""
    c = q.shape[2]
    g_cum = g.cumsum(-1)  # within the block only
    decay = torch.exp(segsum(g))  # Γ (b, h, c, c), 0 above the diagonal
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # L
    rhs = beta[..., None] * (v - torch.exp(g_cum)[..., None] * (k @ h0))  # diag(β)(V − diag(γ) K H_0)
    u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # tril(Γ ⊙ Q Kᵀ): Γ is 0 above the diagonal
    o = scale * (torch.exp(g_cum)[..., None] * (q @ h0) + scores @ u)
    to_end = torch.exp(g_cum[..., -1:] - g_cum)  # γ_end / γ_s ≤ 1
    h_end = torch.exp(g_cum[..., -1])[..., None, None] * h0 + k.transpose(-1, -2) @ (to_end[..., None] * u)
    if not want_matrix:
        return o, h_end
    wy = torch.linalg.solve_triangular(eye + lower, torch.diag_embed(beta), upper=False, unitriangular=True)
    return o, h_end, scale * scores @ wy


def _heads_first(*ts):
    return [t.transpose(1, 2) for t in ts]  # (b, l, h, …) → (b, h, l, …)


def _blocks_at_once(q, k, v, g, beta, s, scale: float):
    """Every block in one pass: q, k (b, h, n, c, d_k), v (b, h, n, c, d_v), g, beta (b, h, n, c),
    s the state entering the first block. Returns (o (b, h, n, c, d_v), the state after the last).

    What does not need a block's entering state is computed for all n blocks together: the decays,
    one triangular solve (U₀ = (I + L)⁻¹ diag(β) V, W = (I + L)⁻¹ diag(βγ) K, so that U = U₀ − W H₀ —
    ``_block``'s solve with the state taken out), the intra-block scores. The loop over blocks keeps
    the state's two products (U = U₀ − W H, H' = γ_end H + Kᵀ diag(γ_end/γ) U), and the outputs are
    one batched product after it: ~5 kernels a block forward instead of ``_block``'s ~35."""
    d_v = v.shape[-1]
    g_cum = g.cumsum(-1)  # within each block
    gamma = torch.exp(g_cum)  # γ
    decay = torch.exp(segsum(g))  # Γ (b, h, n, c, c), 0 above the diagonal
    eye = torch.eye(g.shape[-1], dtype=q.dtype, device=q.device)
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # L
    rhs = torch.cat([beta[..., None] * v, (beta * gamma)[..., None] * k], -1)  # [diag(β) V, diag(βγ) K]
    solved = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
    k_out = (torch.exp(g_cum[..., -1:] - g_cum)[..., None] * k).transpose(-1, -2)  # Kᵀ diag(γ_end / γ), ≤ 1
    # blocks first and contiguous, so a block's slice is a plain batch of matrices; unbind, not
    # indexing in the loop: the backward of each index would write a full-size zero gradient
    u0, w, k_out, g_end = (
        t.movedim(2, 0).contiguous().unbind(0)
        for t in (solved[..., :d_v], solved[..., d_v:], k_out, gamma[..., -1, None, None])
    )
    entering, written = [], []
    for u0_i, w_i, k_i, e_i in zip(u0, w, k_out, g_end):
        entering.append(s)
        u = u0_i - w_i @ s
        written.append(u)
        s = e_i * s + k_i @ u
    states, u = torch.stack(entering, 2), torch.stack(written, 2)  # (b, h, n, d_k, d_v), (b, h, n, c, d_v)
    scores = (q @ k.transpose(-1, -2)) * decay  # tril(Γ ⊙ Q Kᵀ)
    return scale * ((gamma[..., None] * q) @ states + scores @ u), s


def gated_delta_chunked(
    q,
    k,
    v,
    g,
    beta,
    mask=None,
    state=None,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    blocks_at_once: bool | None = None,
    backend: str = "torch",
):
    """Training and prefill: blocks of ``chunk_size`` tokens, the state carried across them.
    Returns (o (b, l, h, d_v) in v's dtype, final state (b, h, d_k, d_v) float32).

    Two schedules of the same arithmetic, tested equal: a loop of ``_block`` calls (the CPU's: a
    block's tensors stay in cache, 14–38 % faster there than the other, measured fwd+bwd at
    1024–4096 tokens), or ``_blocks_at_once`` (the default on CUDA: ~7× fewer kernel launches a
    block; the first GPU run's torch form, a ``_block`` loop, was 5.5× slower a token at 4096 than
    at 1024, which is what a launch-bound loop does).
    ``blocks_at_once`` forces one (None: by the tensors' device).
    ``backend`` (ops/kernels.py): "fla" / "auto" run fla's ``chunk_gated_delta_rule`` where it can."""
    if (
        resolve_backend(backend, q, gated_backward=needs_backward(q, k, v, g, beta, state), op="gated_delta")
        == "fla"
    ):
        from attn2ssm.ops.fla import gated_delta_fla  # optional: attn2ssm[gpu]

        return gated_delta_fla(q, k, v, g, beta, mask, state, scale=scale)
    dtype = v.dtype
    q, k, v, g, beta, m = _prepare(q, k, v, g, beta, mask)
    b, l, h, d_k = q.shape
    d_v = v.shape[-1]
    s = q.new_zeros(b, h, d_k, d_v) if state is None else state.float()
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    c = max(1, int(chunk_size))
    if l == 0:
        o = v.new_zeros(b, 0, h, d_v)
    elif q.is_cuda if blocks_at_once is None else blocks_at_once:
        c = min(c, l)
        pad = (-l) % c  # padded tokens: no key, no write, no decay (α = 1, β = 0, k = 0)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
        n = (l + pad) // c
        blocks = (t.reshape(b, h, n, c, *t.shape[3:]) for t in (q, k, v, g, beta))
        o, s = _blocks_at_once(*blocks, s, _scale(scale, d_k))
        o = o.reshape(b, h, n * c, d_v)[:, :, :l].transpose(1, 2)
    else:
        outs = []
        # split, not slicing in the loop: the backward of each slice would write a full-length zero gradient
        for qc, kc, vc, gc, bc in zip(*(t.split(c, dim=2) for t in (q, k, v, g, beta))):
            o, s = _block(qc, kc, vc, gc, bc, s, _scale(scale, d_k))
            outs.append(o)
        o = torch.cat(outs, 2).transpose(1, 2)
    if m is not None:
        o = o * m[..., None, None]
    return o.to(dtype), s


def gated_delta_quadratic(
    q, k, v, g, beta, mask=None, state=None, *, scale: float | None = None, return_matrix: bool = False
):
    """The whole sequence as one block. Returns (o, final state) and, with ``return_matrix``, also
    the materialised map M (b, h, l, l) with o = M v when there is no initial state (padded rows and
    columns 0)."""
    dtype = v.dtype
    q, k, v, g, beta, m = _prepare(q, k, v, g, beta, mask)
    b, l, h, d_k = q.shape
    s = q.new_zeros(b, h, d_k, v.shape[-1]) if state is None else state.float()
    out = _block(*_heads_first(q, k, v, g, beta), s, _scale(scale, d_k), want_matrix=return_matrix)
    o = out[0].transpose(1, 2)
    if m is not None:
        o = o * m[..., None, None]
    if not return_matrix:
        return o.to(dtype), out[1]
    M = out[2] if m is None else out[2] * m[:, None, :, None] * m[:, None, None, :]
    return o.to(dtype), out[1], M


def gated_delta_step(q, k, v, g, beta, state=None, *, scale: float | None = None):
    """One token: q, k (b, h, d_k), v (b, h, d_v), g, beta (b, h), state (b, h, d_k, d_v) or None.
    Returns (o (b, h, d_v) in v's dtype, new state float32); the old state is kept."""
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    h = q.new_zeros(*k.shape, v.shape[-1]) if state is None else torch.exp(g)[..., None, None] * state.float()
    read = (h * k[..., None]).sum(-2)  # Hᵀ k: what the state holds under k
    u = beta[..., None] * (v - read)
    h = h + k[..., None] * u[..., None, :]
    o = _scale(scale, q.shape[-1]) * (h * q[..., None]).sum(-2)
    return o.to(dtype), h


def gated_delta_sequential(q, k, v, g, beta, mask=None, state=None, *, scale: float | None = None):
    """Token-by-token loop over ``gated_delta_step`` (the reference). Returns (o, final state)."""
    dtype = v.dtype
    q, k, v, g, beta, m = _prepare(q, k, v, g, beta, mask)
    b, l, h, d_k = q.shape
    s = q.new_zeros(b, h, d_k, v.shape[-1]) if state is None else state.float()
    outs = []
    for qt, kt, vt, gt, bt in zip(*(t.unbind(1) for t in (q, k, v, g, beta))):
        o, s = gated_delta_step(qt, kt, vt, gt, bt, s, scale=scale)
        outs.append(o)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    if m is not None:
        o = o * m[..., None, None]
    return o.to(dtype), s
