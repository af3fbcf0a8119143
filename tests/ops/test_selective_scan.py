"""The four forms of the Mamba-1 selective scan agree (fp32, 1e-5), with padding, state and gradients."""

import importlib.util

import pytest
import torch

from attn2ssm.ops.selective_scan import (
    selective_scan_chunked,
    selective_scan_quadratic,
    selective_scan_sequential,
    selective_scan_step,
)
from op_forms import in_pieces, left_padding

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b=2, l=37, g=3, p=4, n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, g, p, generator=gen)
    dt = 0.5 * torch.rand(b, l, g, p, generator=gen)  # already softplus'd: ≥ 0
    A = -4 * torch.rand(g, p, n, generator=gen)
    B = torch.randn(b, l, g, n, generator=gen)
    C = torch.randn(b, l, g, n, generator=gen)
    D = torch.randn(g, p, generator=gen)
    return x, dt, A, B, C, D


def _step_loop(x, dt, A, B, C, D, mask=None, state=None):
    m = torch.ones(x.shape[:2]) if mask is None else mask
    ys = []
    for t in range(x.shape[1]):
        mt = m[:, t, None, None]
        y, state = selective_scan_step(x[:, t] * mt, dt[:, t] * mt, A, B[:, t], C[:, t], state, D=D)
        ys.append(y * mt)
    return torch.stack(ys, 1), state


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_all_forms_agree(chunk, padded):
    x, dt, A, B, C, D = _inputs()
    mask = left_padding(2, 37, [0, 6]) if padded else None
    y_q = selective_scan_quadratic(x, dt, A, B, C, mask=mask, D=D)
    y_c, s_c = selective_scan_chunked(x, dt, A, B, C, mask=mask, D=D, chunk_size=chunk)
    y_s, s_s = selective_scan_sequential(x, dt, A, B, C, mask=mask, D=D)
    y_t, s_t = _step_loop(x, dt, A, B, C, D, mask)
    for y in (y_c, y_s, y_t):
        torch.testing.assert_close(y, y_q, **TOL)
    torch.testing.assert_close(s_c, s_s, **TOL)
    torch.testing.assert_close(s_t, s_s, **TOL)
    if padded:
        assert torch.all(y_c[1, :6] == 0) and torch.all(y_q[1, :6] == 0)
        y_short, s_short = selective_scan_chunked(
            *(t[1:, 6:] for t in (x, dt)), A, *(t[1:, 6:] for t in (B, C)), D=D, chunk_size=chunk
        )
        torch.testing.assert_close(y_c[1:, 6:], y_short, **TOL)
        torch.testing.assert_close(s_c[1:], s_short, **TOL)


def test_matches_the_recurrence_written_out():
    """h_t[p, n] = exp(dt_t[p] A[p, n]) h_{t-1}[p, n] + dt_t[p] B_t[n] x_t[p]; y_t[p] = Σ_n C_t[n] h_t[p, n] + D[p] x_t[p]."""
    x, dt, A, B, C, D = _inputs(b=1, l=6, g=2, p=3, n=2)
    y, _ = selective_scan_chunked(x, dt, A, B, C, D=D, chunk_size=4)
    for gi in range(2):
        for pi in range(3):
            h = torch.zeros(2)
            for t in range(6):
                h = (
                    torch.exp(dt[0, t, gi, pi] * A[gi, pi]) * h
                    + dt[0, t, gi, pi] * B[0, t, gi] * x[0, t, gi, pi]
                )
                expected = C[0, t, gi] @ h + D[gi, pi] * x[0, t, gi, pi]
                torch.testing.assert_close(y[0, t, gi, pi], expected, **TOL)


def test_dt_one_a_zero_is_linear_attention():
    """dt ≡ 1, A ≡ 0: unnormalised causal linear attention per group, y_t = Σ_{s≤t} (C_t·B_s) x_s."""
    x, dt, A, B, C, _ = _inputs(l=12)
    dt, A = torch.ones_like(dt), torch.zeros_like(A)
    scores = torch.einsum("btgn,bsgn->bgts", C, B).tril()
    expected = torch.einsum("bgts,bsgp->btgp", scores, x)
    y_q, W = selective_scan_quadratic(x, dt, A, B, C, return_matrix=True)
    torch.testing.assert_close(y_q, expected, **TOL)
    # same matrix for every channel
    torch.testing.assert_close(W, scores[:, :, None].expand(-1, -1, 4, -1, -1), **TOL)
    for chunk in (1, 5):
        torch.testing.assert_close(
            selective_scan_chunked(x, dt, A, B, C, chunk_size=chunk)[0], expected, **TOL
        )


@pytest.mark.parametrize("chunk", [4, 16])
def test_state_carry_equals_one_pass(chunk):
    """Prefill in pieces (lengths not multiples of the chunk), starting from a non-zero state."""
    x, dt, A, B, C, D = _inputs(l=40)
    s0 = torch.randn(2, 3, 4, 5)
    mask = left_padding(2, 40, [0, 3])
    full, s_full = selective_scan_chunked(x, dt, A, B, C, mask=mask, D=D, state=s0, chunk_size=chunk)
    ref, s_ref = selective_scan_sequential(x, dt, A, B, C, mask=mask, D=D, state=s0)
    torch.testing.assert_close(full, ref, **TOL)
    torch.testing.assert_close(s_full, s_ref, **TOL)
    pieces, state = in_pieces(
        lambda t, s: selective_scan_chunked(
            x[:, t], dt[:, t], A, B[:, t], C[:, t], mask=mask[:, t], D=D, state=s, chunk_size=chunk
        ),
        [13, 14, 40],
        s0,
    )
    torch.testing.assert_close(pieces, full, **TOL)
    torch.testing.assert_close(state, s_full, **TOL)
    y, state = _step_loop(x, dt, A, B, C, D, mask, state=s0)
    torch.testing.assert_close(y, full, **TOL)
    torch.testing.assert_close(state, s_full, **TOL)


def test_gradients_chunked_match_quadratic():
    leaves = [t.requires_grad_(True) for t in _inputs(l=19)]
    mask = left_padding(2, 19, [0, 3])
    g = torch.randn(2, 19, 3, 4)
    (selective_scan_quadratic(*leaves[:5], mask=mask, D=leaves[5]) * g).sum().backward()
    ref = [t.grad.clone() for t in leaves]
    for chunk in (1, 6, 32):
        for t in leaves:
            t.grad = None
        (
            selective_scan_chunked(*leaves[:5], mask=mask, D=leaves[5], chunk_size=chunk)[0] * g
        ).sum().backward()
        for t, r in zip(leaves, ref):
            torch.testing.assert_close(t.grad, r, **TOL)
    # padding: no gradient
    assert torch.all(leaves[0].grad[1, :3] == 0) and torch.all(leaves[1].grad[1, :3] == 0)


def test_gradients_through_state_and_final_state():
    x, dt, A, B, C, D = (t.requires_grad_(True) for t in _inputs(l=11))
    s0 = torch.randn(2, 3, 4, 5, requires_grad=True)
    leaves = [x, dt, A, B, C, D, s0]
    grads = []
    for fn in (
        lambda: selective_scan_chunked(x, dt, A, B, C, D=D, state=s0, chunk_size=4),
        lambda: selective_scan_sequential(x, dt, A, B, C, D=D, state=s0),
    ):
        y, s = fn()
        grads.append(torch.autograd.grad(y.square().sum() + s.sin().sum(), leaves))
    for g_c, g_s in zip(*grads):
        torch.testing.assert_close(g_c, g_s, **TOL)
    # the final state alone (y unused) also back-propagates
    (g,) = torch.autograd.grad(selective_scan_chunked(x, dt, A, B, C, state=s0, chunk_size=4)[1].sum(), [s0])
    (g_ref,) = torch.autograd.grad(selective_scan_sequential(x, dt, A, B, C, state=s0)[1].sum(), [s0])
    torch.testing.assert_close(g, g_ref, **TOL)


def test_strongly_negative_decays_stay_finite():
    x, dt, A, B, C, D = _inputs(l=20)
    dt = (dt + 1.0).requires_grad_(True)
    A = (A * 1e4 - 100.0).requires_grad_(True)  # exp(dt·A) underflows to 0
    expected = dt * x * (C * B).sum(-1)[..., None] + D * x  # no memory: only the current token
    outs = [
        selective_scan_quadratic(x, dt, A, B, C, D=D),
        selective_scan_chunked(x, dt, A, B, C, D=D, chunk_size=8)[0],
        selective_scan_sequential(x, dt, A, B, C, D=D)[0],
    ]
    for y in outs:
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, expected, **TOL)
        grads = torch.autograd.grad(y.sum(), [dt, A])
        assert all(torch.isfinite(t).all() for t in grads)


def test_d_skip():
    x, dt, A, B, C, D = _inputs(l=10)
    y0, _ = selective_scan_chunked(x, dt, A, B, C, chunk_size=4)
    y1, _ = selective_scan_chunked(x, dt, A, B, C, D=D, chunk_size=4)
    torch.testing.assert_close(y1 - y0, D * x, **TOL)


def test_bf16_inputs_computed_in_fp32():
    x, dt, A, B, C, D = _inputs()
    y16, state = selective_scan_chunked(
        *(t.bfloat16() for t in (x, dt)), A, *(t.bfloat16() for t in (B, C)), D=D, chunk_size=8
    )
    ref, _ = selective_scan_chunked(
        *(t.bfloat16().float() for t in (x, dt)),
        A,
        *(t.bfloat16().float() for t in (B, C)),
        D=D,
        chunk_size=8,
    )
    assert y16.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y16.float(), ref, atol=2e-2, rtol=2e-2)


def test_empty_sequence_keeps_state():
    x, dt, A, B, C, D = _inputs(l=0)
    s0 = torch.randn(2, 3, 4, 5)
    y, s = selective_scan_chunked(x, dt, A, B, C, D=D, state=s0)
    assert y.shape == (2, 0, 3, 4)
    torch.testing.assert_close(s, s0)


def test_bad_backend():
    x, dt, A, B, C, _ = _inputs()
    with pytest.raises(ValueError, match="backend"):
        selective_scan_chunked(x, dt, A, B, C, backend="cuda")


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("mamba_ssm") is None,
    reason="needs CUDA and mamba_ssm",
)
def test_cuda_kernel_matches_torch():
    x, dt, A, B, C, D = (t.cuda() for t in _inputs(l=100))
    mask = left_padding(2, 100, [0, 7]).cuda()
    ref = selective_scan_chunked(x, dt, A, B, C, mask=mask, D=D, backend="torch")
    out = selective_scan_chunked(x, dt, A, B, C, mask=mask, D=D, backend="auto")
    torch.testing.assert_close(out[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref[1], atol=1e-4, rtol=1e-4)
