"""The three forms of normalised linear attention agree (fp32, 1e-5), with padding and carried state."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.ops.linear_attention import (
    LinearAttentionState,
    linear_attention_chunked,
    linear_attention_noncausal,
    linear_attention_quadratic,
    linear_attention_sequential,
    linear_attention_step,
)
from op_forms import in_pieces, left_padding, positive_qkv, window_inputs, window_reference


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_three_forms_agree(chunk, padded):
    q, k, v = positive_qkv()
    mask = left_padding(2, 37, [0, 5]) if padded else None
    out_q, weights = linear_attention_quadratic(q, k, v, mask)
    out_c, state_c = linear_attention_chunked(q, k, v, mask, chunk_size=chunk)
    out_r, state_r = linear_attention_sequential(q, k, v, mask)
    torch.testing.assert_close(out_c, out_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_r, out_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_c.kv, state_r.kv, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state_c.k_sum, state_r.k_sum, atol=1e-4, rtol=1e-5)
    # weights are a causal distribution over real keys
    assert torch.all(weights.triu(1) == 0)
    rows = weights.sum(-1)
    if padded:
        assert torch.all(rows[1, :, :5] == 0) and torch.all(weights[1, :, :, :5] == 0)
        torch.testing.assert_close(rows[1, :, 5:], torch.ones_like(rows[1, :, 5:]), atol=1e-5, rtol=0)
        assert torch.all(out_c[1, :, :5] == 0)
    else:
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)


def test_state_carry_equals_one_pass():
    """Prefill in pieces (chunked prefill / decode) gives the one-pass result."""
    q, k, v = positive_qkv(l=40)
    full, _ = linear_attention_chunked(q, k, v, chunk_size=8)
    pieces, _ = in_pieces(
        lambda t, s: linear_attention_chunked(q[:, :, t], k[:, :, t], v[:, :, t], state=s, chunk_size=8),
        [13, 14, 40],
        dim=2,
    )
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=1e-5)


def test_the_step_continues_a_chunked_prefill_and_keeps_the_old_state():
    """Decode as the mixers run it: a chunked prefill, then one ``linear_attention_step`` per token
    from its state, equals one chunked pass; a (copying) step leaves the state it was given
    untouched (a rollback snapshot may hold it)."""
    q, k, v = positive_qkv(l=12)
    full, final = linear_attention_chunked(q, k, v, chunk_size=4)
    out, state = linear_attention_chunked(q[:, :, :5], k[:, :, :5], v[:, :, :5], chunk_size=4)
    outs = [out]
    for t in range(5, 12):
        old = state.kv.clone()
        o, new = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state)
        assert torch.equal(state.kv, old)
        outs.append(o[:, :, None])
        state = new
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.kv, final.kv, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(state.k_sum, final.k_sum, atol=1e-5, rtol=1e-6)


def test_in_place_step_equals_the_copying_one_and_writes_into_the_state():
    q, k, v = positive_qkv(l=6)
    copying = LinearAttentionState.zeros(2, 3, 8, 5)
    owned = LinearAttentionState.zeros(2, 3, 8, 5)
    kv, k_sum = owned.kv, owned.k_sum
    for t in range(6):
        ref, copying = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], copying)
        out, owned = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], owned, inplace=True)
        assert torch.equal(out, ref)
        assert owned.kv is kv and owned.k_sum is k_sum  # no new tensors
    assert torch.equal(kv, copying.kv) and torch.equal(k_sum, copying.k_sum)


def test_matches_explicit_definition():
    """y_i = Σ_{j≤i} (φq_i·φk_j) v_j / Σ_{j≤i} φq_i·φk_j, written as a plain loop."""
    q, k, v = positive_qkv(b=1, h=1, l=6, f=3, d=2)
    out, _ = linear_attention_quadratic(q, k, v, eps=0.0)
    for i in range(6):
        s = torch.stack([q[0, 0, i] @ k[0, 0, j] for j in range(i + 1)])
        expected = (s[:, None] * v[0, 0, : i + 1]).sum(0) / s.sum()
        torch.testing.assert_close(out[0, 0, i], expected, atol=1e-6, rtol=1e-6)


def test_noncausal_matches_quadratic():
    q, k, v = positive_qkv()
    mask = left_padding(2, 37, [0, 3])
    ref, _ = linear_attention_quadratic(q, k, v, mask, causal=False)
    out = linear_attention_noncausal(q, k, v, mask)
    torch.testing.assert_close(out[1, :, 3:], ref[1, :, 3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)


def test_zero_features_stay_finite():
    """ReLU features can be all-zero on a row: eps keeps outputs finite (zero), never NaN."""
    q, k, v = positive_qkv()
    q, k = F.relu(q - 1.5), F.relu(k - 1.5)
    q[:, :, 3] = 0
    for out in (linear_attention_quadratic(q, k, v)[0], linear_attention_chunked(q, k, v, chunk_size=8)[0]):
        assert torch.isfinite(out).all()


def test_half_precision_inputs_computed_in_fp32():
    q, k, v = positive_qkv()
    out16, _ = linear_attention_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk_size=16)
    ref, _ = linear_attention_chunked(
        q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), chunk_size=16
    )
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, atol=2e-2, rtol=2e-2)


def test_state_zeros_shape():
    s = LinearAttentionState.zeros(2, 3, 4, 5)
    assert s.kv.shape == (2, 3, 4, 5) and s.k_sum.shape == (2, 3, 4)


# ---------------------------------------------------------------------------------------------
# sliding window of softmax + linear attention beyond it

from attn2ssm.ops.linear_attention import window_linear_attention  # noqa: E402


def test_window_attention_matches_definition_in_every_form():
    window = 4
    q, k, v, fq, fk = window_inputs(seed=3)
    gamma = torch.tensor([0.3, 0.8])
    mask = left_padding(2, 13, [0, 3])
    ref = window_reference(q, k, v, fq, fk, 0.5, window, gamma, mask)
    kw = dict(scaling=0.5, window=window, gamma=gamma, eps=0.0)
    one, _, weights = window_linear_attention(q, k, v, fq, fk, mask=mask, return_weights=True, **kw)
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)
    rows = weights.sum(-1)
    torch.testing.assert_close(rows[0], torch.ones_like(rows[0]), atol=1e-5, rtol=0)
    run = lambda t, s: window_linear_attention(  # noqa: E731
        *(x[:, :, t] for x in (q, k, v, fq, fk)), mask=mask[:, t], state=s, **kw
    )
    for cuts in ([5, 8, 13], range(1, 14), [4, 5, 6, 13]):  # chunked prefill and token-by-token decode
        out, state = in_pieces(run, cuts, dim=2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert state.keys.shape[2] == window - 1  # the window cache never grows past w − 1


def test_window_covering_everything_is_softmax():
    """With a window longer than the sequence and γ→1, the op is exact causal softmax attention."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g) for _ in range(3))
    fq = fk = torch.ones(1, 2, 9, 3)
    out, _ = window_linear_attention(q, k, v, fq, fk, scaling=0.5, window=100, gamma=torch.ones(2), eps=0.0)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# window > chunk: chunks of max(chunk, window)
@pytest.mark.parametrize("chunk, window", [(4, 4), (4, 3), (5, 2), (3, 5), (64, 4)])
def test_loop_free_window_form_equals_the_definition_its_state_and_gradients(chunk, window):
    from attn2ssm.ops.linear_attention import window_linear_attention_chunked

    g = torch.Generator().manual_seed(5)
    b, h, l, d = 2, 2, 13, 4
    q, k, v, fq, fk = window_inputs(generator=g)
    gamma = torch.tensor([0.3, 0.8])
    mask = left_padding(b, l, [0, 3])
    ref = window_reference(q, k, v, fq, fk, 0.5, window, gamma, mask)
    kw = dict(scaling=0.5, window=window, gamma=gamma, eps=0.0, mask=mask)
    ins = [t.clone().requires_grad_() for t in (q, k, v, fq, fk)]
    out, state = window_linear_attention_chunked(*ins, chunk_size=chunk, return_state=True, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    _, block_state = window_linear_attention(q, k, v, fq, fk, **kw)  # one block: the state a prefill leaves
    for name in ("kv", "k_sum", "keys", "values", "fkeys", "valid"):
        torch.testing.assert_close(getattr(state, name), getattr(block_state, name), atol=1e-5, rtol=1e-5)
    twins = [t.clone().requires_grad_() for t in (q, k, v, fq, fk)]
    w = torch.randn(b, h, l, d, generator=g)
    (out * w).sum().backward()
    (window_linear_attention(*twins, **kw)[0] * w).sum().backward()
    for a, c in zip(ins, twins):
        torch.testing.assert_close(a.grad, c.grad, atol=1e-5, rtol=1e-4)
