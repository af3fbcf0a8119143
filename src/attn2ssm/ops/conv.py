"""Causal depthwise conv1d with a rolling state, as in Mamba's short convolution.

    y_t[c] = act(bias[c] + Σ_{i<k} weight[c, i] · x_{t-k+1+i}[c])

x (b, l, c); weight (c, k) (tap k-1 multiplies the current token, as ``nn.Conv1d`` with left
padding k-1); bias (c,) or None; activation None or "silu". The state (b, c, k-1) holds the previous
k-1 inputs (oldest first), so a sequence fed in pieces — or token by token through
``causal_conv1d_step`` — gives the one-pass result. ``mask`` (b, l): padded inputs are zeroed
before the conv (they enter the state as zeros); outputs at padded positions are not zeroed (they
are act(bias + earlier inputs)) — the mixer masks them downstream. Math in float32; outputs in the
input dtype, states float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attn2ssm.ops.kernels import resolve_backend

_ACTIVATIONS = (None, "silu")
# Up to this many tokens (a speculative verify forward, a short prompt piece) the conv is a weighted
# sum over unfolded windows, as the one-token step computes it: oneDNN's depthwise conv costs
# ~100 us a call on the 2-core CPU for 5 tokens of 960 channels, the sum ~10 us.
SHORT = 16


def _check_activation(activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")


def causal_conv1d(x, weight, bias=None, state=None, mask=None, activation=None, backend: str = "torch"):
    """x (b, l, c) → (y (b, l, c), new state (b, c, k-1) = the last k-1 inputs after masking).

    ``state`` None means zeros (start of sequence). ``backend`` (ops/kernels.py): "fla" / "auto"
    run fla's ``causal_conv1d`` kernel where it can, "torch" this.
    """
    _check_activation(activation)
    if resolve_backend(backend, x) == "fla":
        from attn2ssm.ops.fla import causal_conv1d_fla  # optional: attn2ssm[gpu]

        return causal_conv1d_fla(x, weight, bias, state, mask, activation)
    dtype = x.dtype
    k = weight.shape[-1]
    full = _window(x, k, state, mask)
    new_state = full[..., full.shape[-1] - (k - 1) :].clone()  # also right when l < k-1 (old state shifts)
    w = weight.float()
    if full.shape[-1] - (k - 1) <= SHORT:
        y = (full.unfold(-1, k, 1) * w[:, None, :]).sum(-1)  # (b, c, l): window t is x_{t-k+1..t}
        if bias is not None:
            y = y + bias.float()[:, None]
    else:
        # (b, c, l)
        y = F.conv1d(full, w[:, None, :], None if bias is None else bias.float(), groups=full.shape[1])
    if activation == "silu":
        y = F.silu(y)
    return y.transpose(1, 2).to(dtype), new_state


def causal_conv1d_state(x, width: int, state=None, mask=None):
    """The state (b, c, width-1) after the l tokens of x (b, l, c): what ``causal_conv1d`` returns as
    its new state, without the conv (a speculative rollback to a prefix, student/cache.py)."""
    full = _window(x, width, state, mask)
    return full[..., full.shape[-1] - (width - 1) :].clone()


def _window(x, k, state, mask):
    """(b, c, k-1+l) float32: the carried state (zeros if None), then x with padded inputs zeroed.
    Prepending the state makes the conv exact with no padding; its first k-1 outputs are never formed."""
    b, l, c = x.shape
    x = x.float()
    if mask is not None:
        x = x * mask.to(device=x.device, dtype=torch.float32)[..., None]
    prev = x.new_zeros(b, c, k - 1) if state is None else state.float()
    return torch.cat([prev, x.transpose(1, 2)], dim=-1)


def causal_conv1d_step(x, weight, bias, state, activation=None):
    """One token: x (b, c), state (b, c, k-1) or None (zeros). Returns (y (b, c), new state)."""
    _check_activation(activation)
    dtype = x.dtype
    k = weight.shape[-1]
    x = x.float()
    if state is None:
        state = x.new_zeros(*x.shape, k - 1)
    window = torch.cat([state.float(), x[..., None]], dim=-1)  # (b, c, k): oldest … current
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    return y.to(dtype), window[..., 1:]
