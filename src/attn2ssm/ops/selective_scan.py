"""Mamba-1 selective scan: a diagonal linear recurrence with a decay per channel and state entry.

    h_t[p, n] = exp(dt_t[p] · A[p, n]) · h_{t-1}[p, n] + dt_t[p] · B_t[n] · x_t[p]
    y_t[p]    = Σ_n C_t[n] · h_t[p, n] + D[p] · x_t[p]

Channels come in groups g of p channels; a group shares its B_t, C_t (Mamba's ``ngroups``; the
Mamba-in-the-Llama layout is one group per attention head). Shapes: x, dt (b, l, g, p) with dt ≥ 0
already softplus'd (never applied here); A (g, p, n) ≤ 0; B, C (b, l, g, n); D None or (g, p);
state (b, g, p, n). With dt ≡ 1 and A ≡ 0 this is unnormalised causal linear attention
y_t = Σ_{s≤t} (C_t · B_s) x_s. Four forms that tests hold equal (fp32, 1e-5):

* ``selective_scan_quadratic`` materialises the per-channel (l × l) mixing matrices — tests/plots;
* ``selective_scan_chunked`` training and prefill (below); ``mamba_ssm.selective_scan_fn`` on CUDA
  where it imports (fla has no kernel for a per-channel decay);
* ``selective_scan_step`` one token against the state — decode;
* ``selective_scan_sequential`` the per-token loop over ``selective_scan_step`` — the reference.

``mask`` (b, l): 1 = real token, 0 = padding; a padded token has dt = 0 (decay 1, no input) and
output 0. Math in float32; outputs return in the input dtype, states stay float32.

Why ``selective_scan_chunked`` is a hand-written scan (``_ChunkedScan``) and not SSD-style matmuls:
the decay differs per (p, n), so the in-chunk "attention" form needs a (t, s, p, n) tensor — chunk-length times
the work of the scan itself — and the cheap factorisation exp(cum_t)·exp(-cum_s) overflows. The
scan is O(l·g·p·n) elementwise work; what costs on CPU is autograd's per-step bookkeeping and the
(l, g·p·n) tensors it keeps. So the forward runs the recurrence in place, chunk by chunk, saving only
the state entering each chunk; the backward recomputes each chunk's states from it and runs the
adjoint recurrence g_t = dy_t ⊗ C_t + exp(dt_{t+1}A) ⊙ g_{t+1} backwards. Every exponent is
dt_t·A ≤ 0 for one token, nothing overflows. Memory: the inputs, nc states and one chunk of
temporaries. Not twice differentiable.

Measured (forward+backward, b=1, 576 channels = g 36 × p 16, fp32, torch 2.13 CPU, 2 threads,
OMP_WAIT_POLICY=PASSIVE, best of 2 after a warm-up; the 2-core machine was shared with other jobs,
so absolute times are ~2× an idle machine's and ratios are ±30%):

    n = 16, l = 1024 / 4096:  this (chunk 64) 0.16 / 0.60 s · autograd loop over time on precomputed
        time-major decays/inputs 0.21 / 1.18 s · plain autograd loop (``selective_scan_sequential``)
        0.57 / 2.47 s · autograd two-level scan (in-chunk loop vectorised over chunks, then a loop
        across chunks) 0.37 / 1.47 s · in-chunk (t, s, p, n) quadratic form, chunk 8: 1.40 / 5.84 s
    n = 64, l = 1024 / 4096:  this 0.44 / 1.84 s (chunk 32), 0.61 / 2.18 s (chunk 64) · autograd
        loops 1.38–2.1 / 5.6–6.3 s · two-level 2.55 / 14.7 s
(On an idle machine the same comparison at n = 16 gave 0.09–0.13 s against 0.43–0.55 s at l = 1024.)
Chunk sizes 32–128 are within ~15% of each other; 64 is the default, 32 is a little faster at n = 64.
"""

from __future__ import annotations

import torch

from attn2ssm.ops.ssd import segsum


def _prepare(x, dt, B, C, mask):
    """fp32 copies; padded tokens get dt = 0 (decay 1, no input) and x = 0 (no D skip)."""
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    if mask is None:
        return x, dt, B, C, None
    m = mask.to(device=x.device, dtype=torch.float32)[..., None, None]
    return x * m, dt * m, B, C, m


def _finish(y, x, D, m, dtype):
    if D is not None:
        y = y + D.float() * x
    if m is not None:
        y = y * m
    return y.to(dtype)


def selective_scan_quadratic(x, dt, A, B, C, mask=None, D=None, return_matrix: bool = False):
    """y_t[p] = Σ_{s≤t} W[p, t, s] · dt_s[p] x_s[p] (+ D x) with
    W[p, t, s] = Σ_n C_t[n] B_s[n] exp(A[p, n] · (dt_{s+1} + … + dt_t)[p]).

    Materialises (b, g, p, n, l, l): small inputs only. Returns y (b, l, g, p) and, if
    ``return_matrix``, W · dt_s as (b, g, p, l, l) (the matrix applied to x; D not included)."""
    dtype = x.dtype
    x, dt, B, C, m = _prepare(x, dt, B, C, mask)
    l = x.shape[1]
    lower = torch.ones(l, l, dtype=torch.bool, device=x.device).tril()
    seg = segsum(dt.permute(0, 2, 3, 1)).masked_fill(~lower, 0.0)  # (b, g, p, l, l), 0 above the diagonal
    decay = torch.exp(seg[:, :, :, None] * A.float()[..., None, None])  # (b, g, p, n, l, l), exponent ≤ 0
    cb = C.permute(0, 2, 3, 1)[..., :, None] * B.permute(0, 2, 3, 1)[..., None, :]  # (b, g, n, l, l)
    W = (decay * cb[:, :, None]).sum(3).masked_fill(~lower, 0.0)  # (b, g, p, l, l)
    W = W * dt.permute(0, 2, 3, 1)[..., None, :]  # fold the input scale dt_s in
    y = (W @ x.permute(0, 2, 3, 1)[..., None]).squeeze(-1).permute(0, 3, 1, 2)  # (b, l, g, p)
    y = _finish(y, x, D, m, dtype)
    return (y, W) if return_matrix else y


# ------------------------------------------------------------------------------------ chunked scan
def _chunk_states(x, dt, A, B, h):
    """States of one chunk, time-major: x, dt (L, b, g, p); B (L, b, g, n); h (b, g, p, n) entering.
    Returns (H (L, b, g, p, n) with H[t] = h_t, decays d (L, b, g, p, n))."""
    d = torch.exp(dt[..., None] * A)  # one token's decay: exponent ≤ 0
    H = (dt * x)[..., None] * B[..., None, :]  # inputs u_t, turned into states in place
    Hs, ds = H.unbind(0), d.unbind(0)
    Hs[0].addcmul_(ds[0], h)
    for t in range(1, len(Hs)):
        Hs[t].addcmul_(ds[t], Hs[t - 1])  # in place: one op per token, no autograd graph
    return H, d


class _ChunkedScan(torch.autograd.Function):
    """(x, dt, A, B, C, h0, chunk) → (y without D, final state); inputs time-major fp32 contiguous."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, chunk):
        l = x.shape[0]
        y = x.new_empty(x.shape)
        entering = []
        h = h0
        for s in range(0, l, chunk):
            sl = slice(s, s + chunk)
            entering.append(h)
            H, _ = _chunk_states(x[sl], dt[sl], A, B[sl], h)
            torch.sum(H * C[sl][..., None, :], -1, out=y[sl])
            h = H[-1].clone()
        ctx.save_for_backward(x, dt, A, B, C, torch.stack(entering) if entering else h0[None])
        ctx.chunk = chunk
        return y, h

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dh):
        x, dt, A, B, C, entering = ctx.saved_tensors
        chunk, l = ctx.chunk, x.shape[0]
        dx, ddt, dB, dC = (torch.empty_like(t) for t in (x, dt, B, C))
        dA = torch.zeros_like(A)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        g_next = torch.zeros_like(entering[0]) if dh is None else dh.clone()  # exp(dt_{t+1}A) ⊙ g_{t+1}
        starts = list(range(0, l, chunk))
        for i in reversed(range(len(starts))):
            sl = slice(starts[i], starts[i] + chunk)
            xs, dts, Bs, Cs, dys = x[sl], dt[sl], B[sl], C[sl], dy[sl]
            H, d = _chunk_states(xs, dts, A, Bs, entering[i])  # recompute instead of storing
            G = dys[..., None] * Cs[..., None, :]  # g_t = ∂loss/∂h_t, filled by the adjoint scan
            Gs, ds = G.unbind(0), d.unbind(0)
            Gs[-1].add_(g_next)
            for t in range(len(Gs) - 2, -1, -1):
                Gs[t].addcmul_(ds[t + 1], Gs[t + 1])
            g_next = ds[0] * Gs[0]
            dlog = torch.empty_like(G)  # ∂loss/∂(dt_t·A) = g_t ⊙ d_t ⊙ h_{t-1}
            torch.mul(d[1:], H[:-1], out=dlog[1:])
            torch.mul(d[0], entering[i], out=dlog[0])
            dlog.mul_(G)
            gb = (G * Bs[..., None, :]).sum(-1)  # Σ_n g_t B_t   (L, b, g, p)
            ddt[sl] = (dlog * A).sum(-1) + gb * xs
            dx[sl] = gb * dts
            dA += (dlog * dts[..., None]).sum((0, 1))
            dB[sl] = (G * (dts * xs)[..., None]).sum(-2)
            dC[sl] = (H * dys[..., None]).sum(-2)
        return dx, ddt, dA, dB, dC, g_next, None


def selective_scan_chunked(
    x, dt, A, B, C, mask=None, D=None, state=None, chunk_size: int = 64, backend: str = "torch"
):
    """Training / prefill form; any length. Returns (y (b, l, g, p), final state (b, g, p, n)).

    ``state``: initial state (b, g, p, n) or None (zeros). ``backend`` (ops/kernels.py): fla has no
    kernel for Mamba-1's per-channel decay, so "fla" / "auto" use ``mamba_ssm.selective_scan_fn`` for
    CUDA tensors when it imports and ``state`` is None (the kernel takes no initial state), else
    this; "torch" always this. See the module docstring for the algorithm.
    """
    if backend not in ("auto", "torch", "fla"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'fla', got {backend!r}")
    if backend != "torch" and x.is_cuda and state is None and _selective_scan_fn() is not None:
        return _selective_scan_cuda(x, dt, A, B, C, mask, D)
    dtype = x.dtype
    x, dt, B, C, m = _prepare(x, dt, B, C, mask)
    b, l, g, p = x.shape
    h0 = x.new_zeros(b, g, p, A.shape[-1]) if state is None else state.float()

    def tm(t):
        return t.transpose(0, 1).contiguous()

    y, h = _ChunkedScan.apply(
        tm(x), tm(dt), A.float().contiguous(), tm(B), tm(C), h0, max(1, int(chunk_size))
    )
    return _finish(y.transpose(0, 1), x, D, m, dtype), h


def selective_scan_step(x, dt, A, B, C, state=None, D=None):
    """One token: x, dt (b, g, p); B, C (b, g, n); state (b, g, p, n) or None.
    Returns (y (b, g, p), new state)."""
    dtype = x.dtype
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    decay = torch.exp(dt[..., None] * A.float())
    inp = (dt * x)[..., None] * B[..., None, :]
    state = inp if state is None else decay * state.float() + inp
    y = (state @ C[..., None]).squeeze(-1)
    if D is not None:
        y = y + D.float() * x
    return y.to(dtype), state


def selective_scan_sequential(x, dt, A, B, C, mask=None, D=None, state=None):
    """Token-by-token loop over ``selective_scan_step`` (the reference). Returns (y, final state)."""
    dtype = x.dtype
    x, dt, B, C, m = _prepare(x, dt, B, C, mask)
    if state is None:
        state = x.new_zeros(*x.shape[:1], *x.shape[2:], A.shape[-1])
    ys = []
    # unbind, not x[:, t]: each indexing op's backward would write a full-length zero gradient (O(l²))
    for xt, dtt, Bt, Ct in zip(x.unbind(1), dt.unbind(1), B.unbind(1), C.unbind(1)):
        y, state = selective_scan_step(xt, dtt, A, Bt, Ct, state)
        ys.append(y)
    y = torch.stack(ys, 1) if ys else x.new_zeros(x.shape)
    return _finish(y, x, D, m, dtype), state


# ------------------------------------------------------------------------------------ CUDA path
def _selective_scan_fn():
    """``mamba_ssm``'s ``selective_scan_fn`` if it imports, else None (imported lazily)."""
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except Exception:  # not installed, or built without its CUDA extension
        return None
    return selective_scan_fn


def _selective_scan_cuda(x, dt, A, B, C, mask, D):
    """The kernel computes the same recurrence on channel-major (b, g·p, l) tensors with B, C as
    (b, g, n, l); groups are contiguous channel blocks, as here. Padding: dt = 0, x = 0."""
    dtype = x.dtype
    x, dt, B, C, m = _prepare(x, dt, B, C, mask)
    b, l, g, p = x.shape
    n = A.shape[-1]

    def channels(t):  # (b, l, g, p) → (b, g·p, l)
        return t.reshape(b, l, g * p).transpose(1, 2).contiguous()

    y, last = _selective_scan_fn()(
        channels(x),
        channels(dt),
        A.float().reshape(g * p, n),
        B.permute(0, 2, 3, 1).contiguous(),
        C.permute(0, 2, 3, 1).contiguous(),
        return_last_state=True,
    )
    y = y.float().transpose(1, 2).reshape(b, l, g, p)
    return _finish(y, x, D, m, dtype), last.float().reshape(b, g, p, n)
