"""The four forms of SSD (Mamba-2) agree (fp32, 1e-5), with padding, carried state and gradients."""

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.ops.ssd import segsum, ssd_chunked, ssd_quadratic, ssd_sequential, ssd_state, ssd_step
from op_forms import in_pieces, left_padding

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b=2, l=37, h=3, p=4, n=5, seed=0, decay=0.3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=g)
    a = -decay * torch.rand(b, l, h, generator=g)  # log-decay ≤ 0
    B = torch.randn(b, l, h, n, generator=g) / n**0.5
    C = torch.randn(b, l, h, n, generator=g) / n**0.5
    D = torch.randn(h, generator=g)
    return x, a, B, C, D


def _step_loop(x, a, B, C, D, mask=None, state=None):
    m = torch.ones(x.shape[:2]) if mask is None else mask
    ys = []
    for t in range(x.shape[1]):
        mt = m[:, t]
        y, state = ssd_step(x[:, t] * mt[:, None, None], a[:, t] * mt[:, None], B[:, t], C[:, t], state, D=D)
        ys.append(y * mt[:, None, None])
    return torch.stack(ys, 1), state


def test_segsum_hand_example():
    out = segsum(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    inf = float("-inf")
    expected = torch.tensor(
        [[0.0, inf, inf, inf], [2.0, 0.0, inf, inf], [5.0, 3.0, 0.0, inf], [9.0, 7.0, 4.0, 0.0]]
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    batched = segsum(torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]))
    assert batched.shape == (2, 4, 4)
    torch.testing.assert_close(batched[0], expected, atol=0, rtol=0)


def test_segsum_sums_terms_not_differences_of_prefixes():
    """A huge early term must not wipe out small later ones (cumsum differencing would give 0 or 2)."""
    out = segsum(torch.tensor([1e8, 1.0, 1.0]))
    assert out[2, 1].item() == 1.0 and out[1, 0].item() == 1.0 and out[2, 0].item() == 2.0


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_all_forms_agree(chunk, padded):
    x, a, B, C, D = _inputs()
    mask = left_padding(2, 37, [0, 6]) if padded else None
    y_q = ssd_quadratic(x, a, B, C, mask=mask, D=D)
    y_c, s_c = ssd_chunked(x, a, B, C, mask=mask, D=D, chunk_size=chunk)
    y_s, s_s = ssd_sequential(x, a, B, C, mask=mask, D=D)
    y_t, s_t = _step_loop(x, a, B, C, D, mask)
    for y in (y_c, y_s, y_t):
        torch.testing.assert_close(y, y_q, **TOL)
    torch.testing.assert_close(s_c, s_s, **TOL)
    torch.testing.assert_close(s_t, s_s, **TOL)
    if padded:
        assert torch.all(y_c[1, :6] == 0) and torch.all(y_q[1, :6] == 0)
        # left padding changes nothing for the real tokens: same as the unpadded shorter sequence
        y_short, s_short = ssd_chunked(x[1:, 6:], a[1:, 6:], B[1:, 6:], C[1:, 6:], D=D, chunk_size=chunk)
        torch.testing.assert_close(y_c[1:, 6:], y_short, **TOL)
        torch.testing.assert_close(s_c[1:], s_short, **TOL)


def test_matrix_form():
    x, a, B, C, D = _inputs(l=9)
    mask = left_padding(2, 9, [0, 2])
    y, M = ssd_quadratic(x, a, B, C, mask=mask, D=D, return_matrix=True)
    assert M.shape == (2, 3, 9, 9)
    assert torch.all(M.triu(1) == 0)
    torch.testing.assert_close(
        y,
        torch.einsum("bhts,bshp->bthp", M, x * mask[..., None, None])
        + D[:, None] * x * mask[..., None, None],
        **TOL,
    )
    # one entry by hand: M[t, s] = exp(a_{s+1} + … + a_t) (C_t · B_s)
    bi, hi, t, s = 0, 1, 7, 3
    expected = torch.exp(a[bi, s + 1 : t + 1, hi].sum()) * (C[bi, t, hi] @ B[bi, s, hi])
    torch.testing.assert_close(M[bi, hi, t, s], expected, **TOL)
    torch.testing.assert_close(torch.diagonal(M[0], dim1=-2, dim2=-1), (C[0] * B[0]).sum(-1).T, **TOL)
    # padded rows and columns are zero
    assert torch.all(M[1, :, :2] == 0) and torch.all(M[1, :, :, :2] == 0)


@pytest.mark.parametrize("chunk", [4, 16])
def test_state_carry_equals_one_pass(chunk):
    """Prefill in pieces (lengths not multiples of the chunk), starting from a non-zero state."""
    x, a, B, C, D = _inputs(l=40)
    s0 = torch.randn(2, 3, 4, 5)
    mask = left_padding(2, 40, [0, 3])
    full, s_full = ssd_chunked(x, a, B, C, mask=mask, D=D, state=s0, chunk_size=chunk)
    ref, s_ref = ssd_sequential(x, a, B, C, mask=mask, D=D, state=s0)
    torch.testing.assert_close(full, ref, **TOL)
    torch.testing.assert_close(s_full, s_ref, **TOL)
    pieces, state = in_pieces(
        lambda t, s: ssd_chunked(
            x[:, t], a[:, t], B[:, t], C[:, t], mask=mask[:, t], D=D, state=s, chunk_size=chunk
        ),
        [13, 14, 40],
        s0,
    )
    torch.testing.assert_close(pieces, full, **TOL)
    torch.testing.assert_close(state, s_full, **TOL)
    y, state = _step_loop(x, a, B, C, D, mask, state=s0)
    torch.testing.assert_close(y, full, **TOL)


def test_gradients_chunked_match_quadratic():
    leaves = [t.requires_grad_(True) for t in _inputs(l=19)]
    mask = left_padding(2, 19, [0, 3])
    g = torch.randn(2, 19, 3, 4)
    (ssd_quadratic(*leaves[:4], mask=mask, D=leaves[4]) * g).sum().backward()
    ref = [t.grad.clone() for t in leaves]
    for chunk in (1, 6, 32):
        for t in leaves:
            t.grad = None
        (ssd_chunked(*leaves[:4], mask=mask, D=leaves[4], chunk_size=chunk)[0] * g).sum().backward()
        for t, r in zip(leaves, ref):
            torch.testing.assert_close(t.grad, r, **TOL)
    assert torch.all(leaves[0].grad[1, :3] == 0)  # padded inputs get no gradient


def test_gradients_through_state():
    x, a, B, C, D = (t.requires_grad_(True) for t in _inputs(l=11))
    s0 = torch.randn(2, 3, 4, 5, requires_grad=True)
    grads = []
    for fn in (
        lambda: ssd_chunked(x, a, B, C, D=D, state=s0, chunk_size=4),
        lambda: ssd_sequential(x, a, B, C, D=D, state=s0),
    ):
        y, s = fn()
        grads.append(torch.autograd.grad(y.square().sum() + s.sin().sum(), [x, a, B, C, s0]))
    for g_c, g_s in zip(*grads):
        torch.testing.assert_close(g_c, g_s, **TOL)


def test_strongly_negative_decays_stay_finite():
    x, a, B, C, D = (t.requires_grad_(True) for t in _inputs(l=20))
    a_strong = (a * 1e4 - 50.0).detach().requires_grad_(True)  # exp(a) underflows to 0
    outs = [
        ssd_quadratic(x, a_strong, B, C, D=D),
        ssd_chunked(x, a_strong, B, C, D=D, chunk_size=8)[0],
        ssd_sequential(x, a_strong, B, C, D=D)[0],
    ]
    expected = (C * B).sum(-1)[..., None] * x + D[:, None] * x  # no memory: only the current token
    for y in outs:
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, expected, **TOL)
        (grad_a,) = torch.autograd.grad(y.sum(), [a_strong])
        assert torch.isfinite(grad_a).all()


def test_d_skip_and_no_decay_is_linear_attention():
    """a ≡ 0: unnormalised causal linear attention, y_t = Σ_{s≤t} (C_t·B_s) x_s; D adds D·x."""
    x, a, B, C, D = _inputs(l=12)
    a = torch.zeros_like(a)
    scores = torch.einsum("bthn,bshn->bhts", C, B).tril()
    expected = torch.einsum("bhts,bshp->bthp", scores, x)
    torch.testing.assert_close(ssd_chunked(x, a, B, C, chunk_size=5)[0], expected, **TOL)
    torch.testing.assert_close(
        ssd_chunked(x, a, B, C, D=D, chunk_size=5)[0], expected + D[:, None] * x, **TOL
    )


def test_bf16_inputs_computed_in_fp32():
    x, a, B, C, D = _inputs()
    y16, state = ssd_chunked(*(t.bfloat16() for t in (x, a, B, C)), D=D, chunk_size=8)
    ref, _ = ssd_chunked(*(t.bfloat16().float() for t in (x, a, B, C)), D=D, chunk_size=8)
    assert y16.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y16.float(), ref, atol=2e-2, rtol=2e-2)


def test_empty_sequence_keeps_state():
    x, a, B, C, D = _inputs(l=0)
    s0 = torch.randn(2, 3, 4, 5)
    y, s = ssd_chunked(x, a, B, C, D=D, state=s0)
    assert y.shape == (2, 0, 3, 4)
    torch.testing.assert_close(s, s0)


def test_bad_backend():
    with pytest.raises(ConfigError, match="backend='cuda' is not a kernel choice"):
        ssd_chunked(*_inputs()[:4], backend="cuda")


def test_per_channel_d():
    x, a, B, C, D = _inputs(l=10)
    Dp = D[:, None].expand(3, 4).clone()
    torch.testing.assert_close(
        ssd_chunked(x, a, B, C, D=Dp, chunk_size=4)[0], ssd_chunked(x, a, B, C, D=D, chunk_size=4)[0]
    )
    y_step, _ = ssd_step(x[:, 0], a[:, 0], B[:, 0], C[:, 0], None, D=Dp)
    torch.testing.assert_close(y_step, ssd_quadratic(x, a, B, C, D=D)[:, 0], **TOL)


def test_the_step_continues_a_chunked_prefill_and_keeps_the_old_state():
    """Decode as the mixers run it: a chunked prefill, then one ``ssd_step`` per token from its
    state, equals one chunked pass over the whole sequence; each step leaves the state it was
    given untouched (a rollback snapshot may hold it)."""
    x, a, B, C, _ = _inputs(l=14)
    full, final = ssd_chunked(x, a, B, C, chunk_size=4)
    y, state = ssd_chunked(x[:, :8], a[:, :8], B[:, :8], C[:, :8], chunk_size=4)
    ys = [y]
    for t in range(8, 14):
        old = state.clone()
        y_t, new = ssd_step(x[:, t], a[:, t], B[:, t], C[:, t], state)
        assert torch.equal(state, old)
        ys.append(y_t[:, None])
        state = new
    torch.testing.assert_close(torch.cat(ys, 1), full, **TOL)
    torch.testing.assert_close(state, final, **TOL)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("start", [False, True])
def test_state_alone_equals_the_step_at_every_position(padded, start):
    """``ssd_state`` over the first t tokens (every t, 0 included), from a carried state or none,
    with left padding or not, equals ``ssd_step`` applied token by token up to t, and over all
    tokens equals the chunked form's state: the three ways a state is reached agree."""
    x, a, B, C, D = _inputs(l=9, decay=2.0)
    mask = left_padding(2, 9, [0, 3]) if padded else None
    state = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(3)) if start else None
    m = torch.ones(2, 9) if mask is None else mask
    stepped = state
    for t in range(10):
        got = ssd_state(x[:, :t], a[:, :t], B[:, :t], mask=None if mask is None else mask[:, :t], state=state)
        want = torch.zeros(2, 3, 4, 5) if stepped is None else stepped
        torch.testing.assert_close(got, want, **TOL)
        if t < 9:
            mt = m[:, t]
            _, stepped = ssd_step(
                x[:, t] * mt[:, None, None], a[:, t] * mt[:, None], B[:, t], C[:, t], stepped
            )
    _, chunked = ssd_chunked(x, a, B, C, mask=mask, state=state, chunk_size=4)
    torch.testing.assert_close(ssd_state(x, a, B, mask=mask, state=state), chunked, **TOL)
