"""Bidirectional (non-causal) selective scan, as in Vision Mamba (Vim): a forward and a backward
Mamba-1 scan over the same tokens, each with its own Δ, A, B, C (and D), summed.

    y_t = Σ_{s≤t} C^f_t·B^f_s exp(A^f·(S^f_t − S^f_s)) Δ^f_s x^f_s          (forward, causal)
        + Σ_{s≥t} C^b_t·B^b_s exp(A^b·(S^b_{s−1} − S^b_{t−1})) Δ^b_s x^b_s  (backward, anti-causal)
        + D^f x^f_t + D^b x^b_t,                    S_t = Δ_1 + … + Δ_t  (per channel)

The backward branch is the causal scan run on the flipped sequence and flipped back, which is
how Vim computes it (and what ``bidirectional_scan_chunked`` does); every input here is in
*token order*, the backward ones included. Shapes as in ``ops/selective_scan.py``: x, dt
(b, l, g, p); A (g, p, n); B, C (b, l, g, n); D None or (g, p). A direction is the tuple
``(x, dt, A, B, C, D)``. Two forms that tests hold equal:

* ``bidirectional_scan_quadratic`` materialises the full (l × l) mixing matrix per channel from
  the formula above (no flip, no scan) — the reference;
* ``bidirectional_scan_chunked`` two causal chunked scans (``selective_scan_chunked``).

No masking and no recurrent state: images have no padding and are never decoded token by token.
"""

from __future__ import annotations

import torch

from attn2ssm.ops.selective_scan import selective_scan_chunked


def _flip(t: torch.Tensor) -> torch.Tensor:
    return t.flip(1)


def bidirectional_scan_chunked(
    fw: tuple, bw: tuple, chunk_size: int = 64, backend: str = "auto"
) -> torch.Tensor:
    """Forward scan + flipped-back scan of the flipped backward inputs. Returns y (b, l, g, p) = y_fw + y_bw."""
    x, dt, A, B, C, D = fw
    y_f, _ = selective_scan_chunked(x, dt, A, B, C, D=D, chunk_size=chunk_size, backend=backend)
    x, dt, A, B, C, D = bw
    y_b, _ = selective_scan_chunked(
        _flip(x), _flip(dt), A, _flip(B), _flip(C), D=D, chunk_size=chunk_size, backend=backend
    )
    return y_f + _flip(y_b)


def _direction_matrix(dt, A, B, C, causal: bool) -> torch.Tensor:
    """W (b, g, p, l, l) with W[t, s] the weight of x_s in y_t for one direction (Δ_s folded in)."""
    dt, A, B, C = dt.float(), A.float(), B.float(), C.float()
    l = dt.shape[1]
    S = dt.cumsum(1).permute(0, 2, 3, 1)  # (b, g, p, l): S_t
    if causal:  # decay over tokens s+1..t: S_t − S_s, kept for s ≤ t
        seg = S[..., :, None] - S[..., None, :]
        keep = torch.ones(l, l, dtype=torch.bool, device=dt.device).tril()
    else:  # decay over tokens t..s−1: S_{s−1} − S_{t−1} = (S_s − Δ_s) − (S_t − Δ_t), kept for s ≥ t
        P = S - dt.permute(0, 2, 3, 1)  # S_{t−1}
        seg = P[..., None, :] - P[..., :, None]
        keep = torch.ones(l, l, dtype=torch.bool, device=dt.device).triu()
    seg = seg.masked_fill(~keep, 0.0)  # (b, g, p, t, s), every kept exponent ≤ 0 (A ≤ 0)
    decay = torch.exp(seg[:, :, :, None] * A[..., None, None])  # (b, g, p, n, t, s)
    cb = C.permute(0, 2, 3, 1)[..., :, None] * B.permute(0, 2, 3, 1)[..., None, :]  # (b, g, n, t, s)
    W = (decay * cb[:, :, None]).sum(3).masked_fill(~keep, 0.0)
    return W * dt.permute(0, 2, 3, 1)[..., None, :]


def bidirectional_scan_quadratic(fw: tuple, bw: tuple, return_matrix: bool = False):
    """The reference: y = W_fw x_fw + W_bw x_bw (+ D terms) from the closed form in the module
    docstring. With ``return_matrix``, also (W_fw, W_bw), each (b, g, p, l, l): W_fw lower- and
    W_bw upper-triangular (both include the diagonal, as Vim's two scans both see token t)."""
    dtype = fw[0].dtype
    ys, mats = [], []
    for (x, dt, A, B, C, D), causal in ((fw, True), (bw, False)):
        W = _direction_matrix(dt, A, B, C, causal)
        y = (W @ x.float().permute(0, 2, 3, 1)[..., None]).squeeze(-1).permute(0, 3, 1, 2)  # (b, l, g, p)
        if D is not None:
            y = y + D.float() * x.float()
        ys.append(y)
        mats.append(W)
    y = (ys[0] + ys[1]).to(dtype)
    return (y, tuple(mats)) if return_matrix else y
