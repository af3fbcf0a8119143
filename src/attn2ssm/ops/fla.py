"""attn2ssm's ops through flash-linear-attention's Triton kernels (CUDA; CPU only under Triton's
interpreter, for tests). Each function takes and returns attn2ssm's layouts and states, so a
mixer calls it exactly as it calls the PyTorch form it stands for; this module owns every
difference: fla's [B, T, H, K] layout, its state orientation, scale, fp32 normalisers with our
eps, padding (zeroed inputs), even K/V for 16-bit inputs, and d_k padded to 128 for the gated delta
rule's backward where fla's is wrong at d_k 64 (``PAD_GATED_KEYS``, ``_guard_lifted``).

* ``linear_attention_fla`` — ``linear_attention_chunked``: the numerator Σ (φq·φk) v and the
  state by ``chunk_simple_gla`` (no gate, scale 1); the normaliser φq·Σφk in fp32 here.
* ``ssd_fla`` — ``ssd_chunked``: ``chunk_simple_gla`` with q = C, k = B, v = x, g = a (the
  log-decay; exact at a = 0), D added here; fla's state is (K, V) = (n, p), ours (p, n).
* ``causal_conv1d_fla`` — ``conv.causal_conv1d``: fla's ``causal_conv1d``; its state holds the
  last W inputs, ours the last W − 1.

fla's kernels take their matrix operands in one dtype (``tl.dot`` refuses fp32 × bf16), while under
mixed precision a mixer's features or L2-normalised keys come out fp32 beside 16-bit values:
``_one_dtype`` casts them to the autocast dtype where autocast is on, else to the widest of them.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from attn2ssm.ops.linear_state import LinearAttentionState


def _even(*tensors: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """fla asserts even head dims for 16-bit inputs: pad the last dim of each to even (zeros); returns the pad."""
    pad = tensors[0].shape[-1] % 2 if tensors[0].dtype in (torch.float16, torch.bfloat16) else 0
    return pad, [F.pad(t, (0, pad)) if pad else t for t in tensors]


def _one_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels' matrix operands in one dtype: autocast's where it is on (they are matrix products
    there), else the widest of theirs."""
    device = tensors[0].device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return [t.to(dtype) for t in tensors]


def _bthk(t: torch.Tensor) -> torch.Tensor:
    """(b, h, l, d) → (b, l, h, d) contiguous, fla's layout."""
    return t.transpose(1, 2).contiguous()


def linear_attention_fla(q, k, v, mask=None, state: LinearAttentionState | None = None, *, eps: float = 1e-6):
    """``linear_attention_chunked`` (q, k (b, h, l, f) non-negative features, v (b, h, l, d)) through fla.
    Returns (out (b, h, l, d) in v's dtype, final state (kv (b, h, f, d), k_sum (b, h, f)) float32)."""
    from fla.ops.simple_gla import chunk_simple_gla

    dtype = v.dtype
    b, h, l, f = q.shape
    d = v.shape[-1]
    if mask is not None:  # a padded token is neither a key nor a query
        m = mask[:, None, :, None].to(q.dtype)
        q, k, v = q * m, k * m, v * m
    q, k, v = _one_dtype(q, k, v)
    if state is None:
        state = LinearAttentionState.zeros(b, h, f, d, device=q.device)
    pad_f, (qp, kp) = _even(q, k)
    pad_d, (vp,) = _even(v)
    kv0 = F.pad(state.kv, (0, pad_d, 0, pad_f)).contiguous()
    num, kv = chunk_simple_gla(
        _bthk(qp), _bthk(kp), _bthk(vp), g=None, scale=1.0, initial_state=kv0, output_final_state=True
    )
    num = num[..., :d].transpose(1, 2).float()  # (b, h, l, d)
    k_sum = state.k_sum[:, :, None] + k.float().cumsum(2)  # (b, h, l, f): Σ φk up to each token
    den = (q.float() * k_sum).sum(-1, keepdim=True)
    # a row without keys (padding) is 0 either way; a 1 there keeps the gradient into a 16-bit numerator finite
    den = torch.where(den > 0, den, torch.ones_like(den))
    out = num / (den + eps)
    return out.to(dtype), LinearAttentionState(
        kv[:, :, :f, :d].float(), k_sum[:, :, -1] if l else state.k_sum
    )


def ssd_fla(x, a, B, C, mask=None, D=None, state=None):
    """``ssd_chunked`` (x (b, l, h, p), a (b, l, h) ≤ 0, B, C (b, l, h, n)) through fla.
    Returns (y (b, l, h, p) in x's dtype, final state (b, h, p, n) float32)."""
    from fla.ops.simple_gla import chunk_simple_gla

    dtype = x.dtype
    b, l, h, p = x.shape
    n = B.shape[-1]
    if mask is not None:  # a padded token leaves the state alone: decay 1, no input
        m = mask.to(x.dtype)[..., None, None]
        x, B, C, a = x * m, B * m, C * m, a * mask.to(a.dtype)[..., None]
    x, B, C = _one_dtype(x, B, C)
    pad_n, (Bp, Cp) = _even(B, C)
    pad_p, (xp,) = _even(x)
    h0 = None if state is None else F.pad(state.float().transpose(-1, -2), (0, pad_p, 0, pad_n)).contiguous()
    y, s = chunk_simple_gla(
        Cp.contiguous(),
        Bp.contiguous(),
        xp.contiguous(),
        g=a.float().contiguous(),
        scale=1.0,
        initial_state=h0,
        output_final_state=True,
    )
    y = y[..., :p].float()
    if D is not None:
        D = D.float()
        y = y + (D[:, None] if D.dim() == 1 else D) * x.float()
    if mask is not None:
        y = y * mask.to(y.dtype)[..., None, None]
    return y.to(dtype), s[:, :, :n, :p].transpose(-1, -2).float()


def causal_conv1d_fla(x, weight, bias=None, state=None, mask=None, activation=None):
    """``conv.causal_conv1d`` (x (b, l, c), weight (c, k), state (b, c, k-1)) through fla.
    Returns (y (b, l, c) in x's dtype, new state (b, c, k-1) float32)."""
    from fla.modules.causal_conv1d import causal_conv1d

    dtype = x.dtype
    k = weight.shape[-1]
    if mask is not None:
        x = x * mask.to(x.dtype)[..., None]
    # fla keeps k inputs, the oldest is never read
    h0 = None if state is None else F.pad(state.to(x.dtype), (1, 0)).contiguous()
    y, s = causal_conv1d(
        x.contiguous(),
        weight.to(x.dtype).contiguous(),
        None if bias is None else bias.to(x.dtype),
        initial_state=h0,
        output_final_state=True,
        activation=activation,
    )
    return y.to(dtype), s[..., 1:].float() if s.shape[-1] == k else s.float()


# Whether a differentiated gated delta rule call pads d_k to a multiple of 128 (None: where fla's
# unpadded backward is known wrong, ``ops.kernels.gated_delta_pads_keys``; True / False: always /
# never, for tests on a CPU, where that is never so).
PAD_GATED_KEYS: bool | None = None
KEY_TILE = 128  # fla on Hopper tiles d_k by min(next power of 2, 128): a multiple of 128 gives 128-wide tiles


@contextmanager
def _guard_lifted():
    """fla's refusal of the gated ``chunk_bwd_dqkwg`` on Hopper under Triton 3.4–3.7.0 lifted, for a
    call whose d_k is padded to a multiple of 128: the fault is Triton's code for 64-wide key tiles
    (fla issue #640, bisected: 32- and 128-wide tiles give right gradients), while fla refuses every
    width. tests/kernels checks the padded backward against the PyTorch form on the GPU."""
    import fla.ops.common.chunk_o as chunk_o

    before = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True  # the guard reads: Hopper and >= 3.4.0 and not >= 3.7.1
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = before


class _GuardLiftedBackward(torch.autograd.Function):
    """``run(*inputs)`` (fla's chunk function on padded inputs) recorded on inputs of its own, its
    backward run inside ``_guard_lifted``: fla's own autograd, with its refusal lifted for this call."""

    @staticmethod
    def forward(ctx, run, *inputs):
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            outs = run(*leaves)
        ctx.graph = (outs, leaves)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        outs, leaves = ctx.graph
        del ctx.graph
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(())
        if pairs and wanted:
            with _guard_lifted():
                got = iter(
                    torch.autograd.grad(
                        [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
                    )
                )
        return (None, *(next(got) if t is not None and t.requires_grad else None for t in leaves))


def _pads_keys(q, trains: bool) -> bool:
    if PAD_GATED_KEYS is not None:
        return PAD_GATED_KEYS and trains
    from attn2ssm.ops.kernels import gated_delta_pads_keys

    return trains and gated_delta_pads_keys(q.device, q.dtype)


def gated_delta_fla(q, k, v, g, beta, mask=None, state=None, *, scale: float | None = None):
    """``gated_delta_chunked`` (q, k (b, l, h, d_k) L2-normalised, v (b, l, h, d_v), g, beta (b, l, h))
    through fla's ``chunk_gated_delta_rule``. Returns (o in v's dtype, final state (b, h, d_k, d_v) float32).

    A call that will be differentiated where fla's unpadded gated backward is wrong (``_pads_keys``)
    zero-pads q and k (and the state's rows) to a multiple of 128 in d_k: zero key columns add
    nothing to any product, the scale is the true d_k's, and the gradients are sliced back."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from attn2ssm.ops.kernels import needs_backward

    dtype = v.dtype
    d_k, d_v = q.shape[-1], v.shape[-1]
    padded = _pads_keys(q, needs_backward(q, k, v, g, beta, state))
    if mask is not None:  # a padded token: no key, no write, no decay
        m = mask.to(q.dtype)[..., None]
        q, k = q * m[..., None], k * m[..., None]
        g, beta = g * mask.to(g.dtype)[..., None], beta * mask.to(beta.dtype)[..., None]
    q, k, v = _one_dtype(q, k, v)
    if padded:
        pad_k = -d_k % KEY_TILE + (KEY_TILE if d_k == 0 else 0)
        qp, kp = (F.pad(t, (0, pad_k)) for t in (q, k))
    else:
        pad_k, (qp, kp) = _even(q, k)
    pad_v, (vp,) = _even(v)
    h0 = None if state is None else F.pad(state.float(), (0, pad_v, 0, pad_k)).contiguous()
    scale = d_k**-0.5 if scale is None else scale  # the true d_k's, never the padded one

    def run(q_, k_, v_, g_, beta_, h0_):
        return chunk_gated_delta_rule(
            q_, k_, v_, g_, beta_, scale=scale, initial_state=h0_, output_final_state=True
        )

    inputs = (qp.contiguous(), kp.contiguous(), vp.contiguous(), g.float().contiguous())
    inputs += (beta.to(q.dtype).contiguous(), h0)
    o, s = _GuardLiftedBackward.apply(run, *inputs) if padded else run(*inputs)
    o = o[..., :d_v]
    if mask is not None:
        o = o * mask.to(o.dtype)[..., None, None]
    return o.to(dtype), s[:, :, :d_k, :d_v].float()
