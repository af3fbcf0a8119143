"""What the op-form tests share (docs/design.md, "The forms of an op"): a left-padding mask, and a
chunked form run over a sequence in pieces with its state carried from one piece to the next, whose
outputs must equal one pass over the whole sequence; and the linear-attention tests' inputs and the
per-query definition of window + linear attention (with or without a decay) they are held to."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


def left_padding(b: int, l: int, pads: Sequence[int]) -> torch.Tensor:
    """A (b, l) mask of ones whose row i starts with ``pads[i]`` zeros (padding on the left)."""
    mask = torch.ones(b, l)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
    return mask


def in_pieces(run: Callable, cuts: Sequence[int], state=None, dim: int = 1):
    """``run(part, state) -> (out, state)`` on the pieces ``[0, cuts[0])``, ``[cuts[0], cuts[1])``, …
    (``part`` a slice of the time axis), each starting from the state the one before left;
    (the outputs concatenated along ``dim``, the last state)."""
    outs, start = [], 0
    for end in cuts:
        out, state = run(slice(start, end), state)
        outs.append(out)
        start = end
    return torch.cat(outs, dim), state


def positive_qkv(b=2, h=3, l=37, f=8, d=5, seed=0):
    """Linear attention's (q, k, v): queries and keys already feature-mapped, 1 + ELU (positive),
    (b, h, l, f); values (b, h, l, d)."""
    g = torch.Generator().manual_seed(seed)
    q = F.elu(torch.randn(b, h, l, f, generator=g)) + 1
    k = F.elu(torch.randn(b, h, l, f, generator=g)) + 1
    v = torch.randn(b, h, l, d, generator=g)
    return q, k, v


def window_inputs(b=2, h=2, l=13, d=4, f=6, seed=5, generator=None):
    """Window + linear attention's (q, k, v, fq, fk): q, k, v (b, h, l, d) and positive features
    fq, fk (b, h, l, f), drawn from ``generator`` when given (to draw more after), else from ``seed``."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, l, d, generator=g) for _ in range(3))
    fq, fk = (F.elu(torch.randn(b, h, l, f, generator=g)) + 1 for _ in range(2))
    return q, k, v, fq, fk


def window_reference(q, k, v, fq, fk, scaling, window, gamma, mask, log_decay=None):
    """Per-query loop straight from the definition: γ·exp(s − m) on the keys in the window (m their
    largest score), λ^(i−j)·φq·φk beyond it (λ = 1 without ``log_decay``), over the real keys."""
    b, h, l, d = q.shape
    out = torch.zeros(b, h, l, d)
    for bi in range(b):
        for hi in range(h):
            lam = 1.0 if log_decay is None else float(torch.exp(log_decay[hi]))
            for i in range(l):
                if mask[bi, i] == 0:
                    continue
                keys = [j for j in range(i + 1) if mask[bi, j] > 0]
                win = [j for j in keys if i - j < window]
                m = max(float(q[bi, hi, i] @ k[bi, hi, j]) * scaling for j in win)
                w = {
                    j: gamma[hi] * torch.exp(q[bi, hi, i] @ k[bi, hi, j] * scaling - m)
                    if j in win
                    else lam ** (i - j) * (fq[bi, hi, i] @ fk[bi, hi, j])
                    for j in keys
                }
                out[bi, hi, i] = sum(w[j] * v[bi, hi, j] for j in keys) / sum(w.values())
    return out
