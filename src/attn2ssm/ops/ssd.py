"""Mamba-2 / SSD: a linear recurrence with one scalar decay per head and token.

    h_t = exp(a_t) · h_{t-1} + x_t ⊗ B_t        h: (p, n) per head, a_t ≤ 0 (log-decay)
    y_t = h_t · C_t + D · x_t

Unrolled, y = M x + D x with M[t, s] = exp(a_{s+1} + … + a_t) · (C_t · B_s) for s ≤ t: causal
linear attention whose mask decays (``exp(segsum(a))``). Shapes: x (b, l, h, p), a (b, l, h),
B, C (b, l, h, n), D None or (h,) (or (h, p)), state (b, h, p, n). Four forms that tests hold
equal (fp32, 1e-5):

* ``ssd_quadratic`` materialises M (b, h, l, l) — for distillation losses against attention maps;
* ``ssd_chunked`` the SSD algorithm (quadratic inside chunks, states carried across them) —
  training and prefill, O(l·C·(n + p) + l·n·p); fla's kernel through ``backend`` (ops/kernels.py);
* ``ssd_step`` one token against the state — decode (every mixer's one-token step);
* ``ssd_sequential`` the per-token loop over ``ssd_step`` — the plain reference.

``ssd_state`` is the state alone (no outputs), equal to the state each form returns.

``mask`` (b, l): 1 = real token, 0 = padding. A padded token leaves the state unchanged (decay 1,
no input) and its output is 0. Math runs in float32; outputs return in the input dtype, states
stay float32. Every exponent the code takes is a sum of log-decays over a forward interval
(≤ 0), so strongly negative decays underflow to 0 instead of overflowing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.ops.kernels import needs_backward, resolve_backend


def segsum(x: torch.Tensor) -> torch.Tensor:
    """(..., T) → (..., T, T): out[i, j] = x_{j+1} + … + x_i for i ≥ j (0 on the diagonal), -inf above.

    Built by masking then one cumsum, so each entry is a sum of the terms it names — never a
    difference of two long prefix sums, which would cancel catastrophically.
    """
    T = x.size(-1)
    lower = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    strict = lower.tril(-1)
    terms = x[..., :, None].expand(*x.shape, T).masked_fill(~strict, 0.0)  # terms[i, j] = x_i if i > j
    out = terms.cumsum(-2)  # out[i, j] = Σ_{j < k ≤ i} x_k
    return out.masked_fill(~lower, float("-inf"))


def _prepare(x, a, B, C, mask):
    """fp32 copies with padded tokens neutralised: decay 1 (a = 0), no input (x = 0, B = 0)."""
    x, a, B, C = x.float(), a.float(), B.float(), C.float()
    if mask is None:
        return x, a, B, C, None
    m = mask.to(device=x.device, dtype=torch.float32)
    return x * m[..., None, None], a * m[..., None], B * m[..., None, None], C * m[..., None, None], m


def _skip(D, x):
    """D·x for D of shape (h,) (one skip per head) or (h, p) (per channel)."""
    D = D.float()
    return (D[:, None] if D.dim() == 1 else D) * x


def _finish(y, x, D, m, dtype):
    if D is not None:
        y = y + _skip(D, x)
    if m is not None:
        y = y * m[..., None, None]
    return y.to(dtype)


def ssd_quadratic(x, a, B, C, mask=None, D=None, return_matrix: bool = False):
    """y = M x (+ D x) with M[t, s] = exp(segsum(a))[t, s] · (C_t · B_s). Returns y (b, l, h, p)
    and, if ``return_matrix``, M (b, h, l, l) (D not included; padded rows and columns are 0)."""
    dtype = x.dtype
    x, a, B, C, m = _prepare(x, a, B, C, mask)
    decay = torch.exp(segsum(a.transpose(1, 2)))  # (b, h, l, l), 0 above the diagonal
    M = (C.transpose(1, 2) @ B.permute(0, 2, 3, 1)) * decay  # (b, h, l, n) @ (b, h, n, l)
    y = (M @ x.transpose(1, 2)).transpose(1, 2)  # (b, l, h, p)
    y = _finish(y, x, D, m, dtype)
    return (y, M) if return_matrix else y


def ssd_chunked(x, a, B, C, mask=None, D=None, state=None, chunk_size: int = 64, backend: str = "torch"):
    """The chunked SSD algorithm; any length l. Returns (y (b, l, h, p), final state (b, h, p, n)).

    ``state``: initial state (b, h, p, n) or None (zeros). ``backend`` (ops/kernels.py): "fla" /
    "auto" run fla's ``chunk_simple_gla`` where it can (exact, a log-decay of 0 included), "torch" this.
    """
    if resolve_backend(backend, x, gated_backward=needs_backward(x, a, B, C, D, state), op="ssd") == "fla":
        from attn2ssm.ops.fla import ssd_fla  # optional: attn2ssm[gpu]

        return ssd_fla(x, a, B, C, mask, D, state)
    dtype = x.dtype
    x, a, B, C, m = _prepare(x, a, B, C, mask)
    b, l, h, p = x.shape
    n = B.shape[-1]
    if l == 0:
        s = x.new_zeros(b, h, p, n) if state is None else state.float()
        return x.to(dtype), s
    cs = max(1, min(int(chunk_size), l))
    pad = (-l) % cs
    if pad:  # zero tail: decay 1 and no input, so the final state is the one after token l
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        a = F.pad(a, (0, 0, 0, pad))
    nc = (l + pad) // cs

    def chunks(t):  # (b, l, h, d) → (b, h, nc, cs, d)
        return t.reshape(b, nc, cs, h, t.shape[-1]).permute(0, 3, 1, 2, 4)

    xc, Bc, Cc = chunks(x), chunks(B), chunks(C)
    ac = a.reshape(b, nc, cs, h).permute(0, 3, 1, 2)  # (b, h, nc, cs)
    a_cum = ac.cumsum(-1)  # within-chunk prefix sums only: |a_cum| grows over cs tokens, not l

    # 1. inside each chunk: the quadratic form
    scores = (Cc @ Bc.transpose(-1, -2)) * torch.exp(segsum(ac))  # (b, h, nc, cs, cs)
    y = scores @ xc  # (b, h, nc, cs, p)

    # 2. the state each chunk adds by its end: Σ_s exp(a_{s+1} + … + a_end) x_s ⊗ B_s
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # t_end ≥ s: exponent ≤ 0
    chunk_states = xc.transpose(-1, -2) @ (Bc * to_end[..., None])  # (b, h, nc, p, n)

    # 3. carry states across chunks (a short loop: nc steps on (b, h, p, n) tensors)
    s = torch.zeros(b, h, p, n, device=x.device) if state is None else state.float()
    entering = []
    for decay, add in zip(torch.exp(a_cum[..., -1]).unbind(2), chunk_states.unbind(2)):
        entering.append(s)
        s = decay[..., None, None] * s + add
    entering = torch.stack(entering, 2)  # (b, h, nc, p, n): state before each chunk

    # 4. what the entering state contributes inside each chunk
    y = y + (Cc * torch.exp(a_cum)[..., None]) @ entering.transpose(-1, -2)
    y = y.permute(0, 2, 3, 1, 4).reshape(b, nc * cs, h, p)[:, :l]
    return _finish(y, x[:, :l], D, m, dtype), s


def ssd_step(x, a, B, C, state=None, D=None):
    """One token: x (b, h, p), a (b, h), B, C (b, h, n), state (b, h, p, n) or None (zeros).
    Returns (y (b, h, p) in x's dtype, new state (b, h, p, n) float32); the old state is kept
    (a rollback snapshot may hold it). In the fewest ops (decode speed): the state update is one
    ``addcmul``, the readout one batched matmul."""
    dtype = x.dtype
    x, a, B, C = x.float(), a.float(), B.float(), C.float()
    b, h, p = x.shape
    n = B.shape[-1]
    inp = x[..., :, None]
    if state is None:
        state = inp * B[..., None, :]
    else:
        state = torch.addcmul(torch.exp(a)[..., None, None] * state.float(), inp, B[..., None, :])
    y = torch.bmm(state.reshape(b * h, p, n), C.reshape(b * h, n, 1)).view(b, h, p)
    if D is not None:
        y = y + _skip(D, x)
    return (y if y.dtype == dtype else y.to(dtype)), state


def ssd_state(x, a, B, mask=None, state=None):
    """The state (b, h, p, n) float32 after the l tokens, without the outputs: what ``ssd_chunked``
    and ``ssd_sequential`` return as their state, in one product,
        h_l = exp(a_1 + … + a_l) · state + Σ_s exp(a_{s+1} + … + a_l) · x_s ⊗ B_s.
    For a speculative rollback (Mamba in the Llama §4): the state after a kept prefix of a verify
    forward, from the x, a, B it already computed (student/cache.py). Each exponent is a suffix
    sum of the terms it names (never a difference of prefix sums), so it is exact at any l."""
    x, a, B = x.float(), a.float(), B.float()
    b, l, h, p = x.shape
    if mask is not None:  # a padded token leaves the state alone: decay 1, no input
        m = mask.to(device=x.device, dtype=torch.float32)
        x, a = x * m[..., None, None], a * m[..., None]
    suffix = a.flip(1).cumsum(1).flip(1)  # (b, l, h): a_s + … + a_l
    after = F.pad(suffix[:, 1:], (0, 0, 0, 1))  # a_{s+1} + … + a_l, 0 for the last token
    s = torch.einsum("blhp,blhn->bhpn", x * torch.exp(after)[..., None], B)
    if state is not None:
        decay = torch.exp(suffix[:, 0]) if l else torch.ones(b, h, device=x.device)
        s = s + decay[..., None, None] * state.float()
    return s


def ssd_sequential(x, a, B, C, mask=None, D=None, state=None):
    """Token-by-token loop over ``ssd_step`` (the reference). Returns (y, final state)."""
    dtype = x.dtype
    x, a, B, C, m = _prepare(x, a, B, C, mask)
    ys = []
    # unbind, not x[:, t]: each indexing op's backward would write a full-length zero gradient (O(l²))
    for xt, at, Bt, Ct in zip(x.unbind(1), a.unbind(1), B.unbind(1), C.unbind(1)):
        y, state = ssd_step(xt, at, Bt, Ct, state)
        ys.append(y)
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    y = torch.stack(ys, 1) if ys else x.new_zeros(x.shape)
    return _finish(y, x, D, m, dtype), state
