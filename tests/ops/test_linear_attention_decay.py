"""Linear attention with a learned per-head decay (``log_decay``): key j's linear weight for query i
is λ_h^(i−j)·φq_i·φk_j. Every form (quadratic, chunked, step, sequential; window block and
loop-free window) equals the definition (fp32, 1e-5), with left padding, in pieces with carried
state, with equal gradients; λ = 1 is today's undecayed op."""

import pytest
import torch

from attn2ssm.ops.linear_attention import (
    _decayed_exclusive_cumsum,
    linear_attention_chunked,
    linear_attention_quadratic,
    linear_attention_sequential,
    linear_attention_step,
    window_linear_attention,
    window_linear_attention_chunked,
    window_linear_attention_step,
)
from op_forms import in_pieces, left_padding, positive_qkv, window_inputs, window_reference

LOG_DECAY = torch.log(torch.tensor([0.9, 0.5, 0.99]))  # three heads, from mild to strong


def _reference(q, k, v, log_decay, mask=None):
    """Per-query loop straight from the definition y_i = Σ_j λ^(i−j) φq_i·φk_j v_j / Σ_j λ^(i−j) φq_i·φk_j."""
    b, h, l, _ = q.shape
    mask = torch.ones(b, l) if mask is None else mask
    out = torch.zeros(b, h, l, v.shape[-1])
    for bi in range(b):
        for hi in range(h):
            lam = float(torch.exp(log_decay[hi]))
            for i in range(l):
                if mask[bi, i] == 0:
                    continue
                w = {
                    j: lam ** (i - j) * float(q[bi, hi, i] @ k[bi, hi, j])
                    for j in range(i + 1)
                    if mask[bi, j] > 0
                }
                out[bi, hi, i] = sum(w[j] * v[bi, hi, j] for j in w) / sum(w.values())
    return out


def test_decay_hand_computed_three_tokens():
    """f = 1, φq = 1, φk = (1, 2, 3), v = (1, 10, 100), λ = 0.5: y_2 = (0.25·1 + 0.5·2·10 + 3·100) / (0.25 + 1 + 3)."""
    q = torch.ones(1, 1, 3, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(1, 1, 3, 1)
    v = torch.tensor([1.0, 10.0, 100.0]).view(1, 1, 3, 1)
    g = torch.log(torch.tensor([0.5]))
    want = torch.tensor([1.0, (0.5 * 1 + 2 * 10) / (0.5 + 2), (0.25 + 10 + 300) / 4.25]).view(1, 1, 3, 1)
    for out in (
        linear_attention_quadratic(q, k, v, log_decay=g, eps=0.0)[0],
        linear_attention_chunked(q, k, v, log_decay=g, chunk_size=2, eps=0.0)[0],
        linear_attention_sequential(q, k, v, log_decay=g, eps=0.0)[0],
    ):
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("padded", [False, True])
def test_decayed_forms_agree_with_the_definition(chunk, padded):
    q, k, v = positive_qkv()
    mask = left_padding(2, 37, [0, 5]) if padded else None
    ref = _reference(q, k, v, LOG_DECAY, mask)
    out_q, weights = linear_attention_quadratic(q, k, v, mask, log_decay=LOG_DECAY)
    out_c, state_c = linear_attention_chunked(q, k, v, mask, chunk_size=chunk, log_decay=LOG_DECAY)
    out_r, state_r = linear_attention_sequential(q, k, v, mask, log_decay=LOG_DECAY)
    for out in (out_q, out_c, out_r):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_c.kv, state_r.kv, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state_c.k_sum, state_r.k_sum, atol=1e-4, rtol=1e-5)
    assert torch.all(weights.triu(1) == 0)


def test_a_left_padded_row_equals_the_unpadded_row():
    """Weights depend on i − j only: left padding shifts a row without changing it."""
    q, k, v = positive_qkv(b=1, l=20)
    pad = lambda t: torch.cat([torch.randn(1, 3, 6, t.shape[-1]).abs(), t], 2)  # noqa: E731
    mask = left_padding(1, 26, [6])
    alone, state = linear_attention_chunked(q, k, v, chunk_size=8, log_decay=LOG_DECAY)
    padded, pstate = linear_attention_chunked(pad(q), pad(k), pad(v), mask, chunk_size=8, log_decay=LOG_DECAY)
    torch.testing.assert_close(padded[:, :, 6:], alone, atol=1e-5, rtol=1e-5)
    assert torch.all(padded[:, :, :6] == 0)
    torch.testing.assert_close(pstate.kv, state.kv, atol=1e-5, rtol=1e-5)


def test_decayed_state_carry_and_steps_equal_one_pass():
    """Chunked prefill in pieces, then one step per token (copying and in place), equals one pass."""
    q, k, v = positive_qkv(l=40)
    full, final = linear_attention_chunked(q, k, v, chunk_size=8, log_decay=LOG_DECAY)
    run = lambda t, s: linear_attention_chunked(  # noqa: E731
        q[:, :, t], k[:, :, t], v[:, :, t], state=s, chunk_size=8, log_decay=LOG_DECAY
    )
    pieces, state = in_pieces(run, [13, 14, 30], dim=2)
    outs = [pieces]
    for t in range(30, 40):
        inplace = t % 2 == 0
        o, state = linear_attention_step(
            q[:, :, t], k[:, :, t], v[:, :, t], state, log_decay=LOG_DECAY, inplace=inplace
        )
        outs.append(o[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.kv, final.kv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.k_sum, final.k_sum, atol=1e-5, rtol=1e-5)


def test_decay_one_is_the_undecayed_op():
    q, k, v = positive_qkv()
    mask = left_padding(2, 37, [0, 5])
    one = torch.zeros(3)
    pairs = [
        (
            linear_attention_quadratic(q, k, v, mask)[0],
            linear_attention_quadratic(q, k, v, mask, log_decay=one)[0],
        ),
        (
            linear_attention_chunked(q, k, v, mask, chunk_size=8)[0],
            linear_attention_chunked(q, k, v, mask, chunk_size=8, log_decay=one)[0],
        ),
        (
            linear_attention_sequential(q, k, v, mask)[0],
            linear_attention_sequential(q, k, v, mask, log_decay=one)[0],
        ),
    ]
    wq, wk, wv, fq, fk = window_inputs()
    kw = dict(scaling=0.5, window=4, gamma=torch.tensor([0.3, 0.8]), mask=left_padding(2, 13, [0, 3]))
    pairs.append(
        (
            window_linear_attention(wq, wk, wv, fq, fk, **kw)[0],
            window_linear_attention(wq, wk, wv, fq, fk, log_decay=torch.zeros(2), **kw)[0],
        )
    )
    pairs.append(
        (
            window_linear_attention_chunked(wq, wk, wv, fq, fk, chunk_size=4, **kw)[0],
            window_linear_attention_chunked(wq, wk, wv, fq, fk, chunk_size=4, log_decay=torch.zeros(2), **kw)[
                0
            ],
        )
    )
    for undecayed, decayed in pairs:
        torch.testing.assert_close(decayed, undecayed, atol=1e-6, rtol=1e-6)


def test_chunk_state_sums_by_loop_and_by_matrix_agree():
    """``_decayed_exclusive_cumsum``: the CPU loop and the loop-free matrix form (other devices)."""
    t = torch.randn(2, 3, 9, 4, 5)
    g = torch.log(torch.tensor([0.3, 0.9, 1.0]))
    for shift in (1, 2):
        want = torch.zeros_like(t)
        for n in range(9):
            for m in range(n - shift + 1):
                want[:, :, n] += torch.exp(g).view(1, 3, 1, 1) ** (n - shift - m) * t[:, :, m]
        for loop in (True, False):
            torch.testing.assert_close(
                _decayed_exclusive_cumsum(t, g, shift, loop=loop), want, atol=1e-5, rtol=1e-5
            )


def test_decayed_gradients_finite_and_equal_between_forms():
    q, k, v = positive_qkv(l=29)
    g = LOG_DECAY.clone()
    grads = []
    for form in ("quadratic", "chunked"):
        ins = [t.clone().requires_grad_() for t in (q, k, v, g)]
        if form == "quadratic":
            out = linear_attention_quadratic(*ins[:3], log_decay=ins[3])[0]
        else:
            out = linear_attention_chunked(*ins[:3], chunk_size=8, log_decay=ins[3])[0]
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        grads.append([t.grad for t in ins])
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert grads[0][3].abs().sum() > 0  # the decay learns


def test_strong_decay_over_a_long_sequence_stays_finite_and_equal():
    """λ = 0.01 over 600 tokens: powers underflow to 0, never overflow — chunked equals quadratic."""
    q, k, v = positive_qkv(b=1, h=2, l=600, seed=2)
    g = torch.log(torch.tensor([0.01, 0.999]))
    out_q = linear_attention_quadratic(q, k, v, log_decay=g)[0]
    out_c, state = linear_attention_chunked(q, k, v, chunk_size=64, log_decay=g)
    assert torch.isfinite(out_c).all() and torch.isfinite(state.kv).all()
    torch.testing.assert_close(out_c, out_q, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# window + decayed linear attention


@pytest.mark.parametrize("chunk, window", [(4, 4), (4, 3), (5, 2), (3, 5)])
def test_decayed_window_forms_equal_the_definition_in_pieces_and_loop_free(chunk, window):
    q, k, v, fq, fk = window_inputs()
    gamma, g = torch.tensor([0.3, 0.8]), torch.log(torch.tensor([0.7, 0.95]))
    mask = left_padding(2, 13, [0, 3])
    ref = window_reference(q, k, v, fq, fk, 0.5, window, gamma, mask, log_decay=g)
    kw = dict(scaling=0.5, window=window, gamma=gamma, eps=0.0, mask=mask, log_decay=g)
    one, one_state, weights = window_linear_attention(q, k, v, fq, fk, return_weights=True, **kw)
    torch.testing.assert_close(one, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1)[0], torch.ones(2, 13), atol=1e-5, rtol=0)
    run = lambda t, s: window_linear_attention(  # noqa: E731
        *(x[:, :, t] for x in (q, k, v, fq, fk)), state=s, **dict(kw, mask=mask[:, t])
    )
    for cuts in ([5, 8, 13], range(1, 14), [4, 5, 6, 13]):  # chunked prefill and token-by-token decode
        out, state = in_pieces(run, cuts, dim=2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.kv, one_state.kv, atol=1e-5, rtol=1e-5)
    ins = [t.clone().requires_grad_() for t in (q, k, v, fq, fk)]
    out, state = window_linear_attention_chunked(*ins, chunk_size=chunk, return_state=True, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name in ("kv", "k_sum", "keys", "values", "fkeys", "valid"):
        torch.testing.assert_close(getattr(state, name), getattr(one_state, name), atol=1e-5, rtol=1e-5)
    twins = [t.clone().requires_grad_() for t in (q, k, v, fq, fk)]
    w = torch.randn(2, 2, 13, 4)
    (out * w).sum().backward()
    (window_linear_attention(*twins, **kw)[0] * w).sum().backward()
    for a, c in zip(ins, twins):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, c.grad, atol=1e-5, rtol=1e-4)


def test_decayed_window_state_continues_into_a_longer_sequence():
    """A window prefill's state (loop-free form) continued block by block equals one pass (long,
    strong decay: no overflow)."""
    q, k, v, fq, fk = window_inputs(b=1, l=300, seed=6)
    kw = dict(
        scaling=0.5, window=8, gamma=torch.tensor([0.5, 0.5]), log_decay=torch.log(torch.tensor([0.01, 0.99]))
    )
    full, _ = window_linear_attention(q, k, v, fq, fk, **kw)
    head, state = window_linear_attention_chunked(
        *(t[:, :, :170] for t in (q, k, v, fq, fk)), chunk_size=16, return_state=True, **kw
    )
    tail, _ = window_linear_attention(*(t[:, :, 170:] for t in (q, k, v, fq, fk)), state=state, **kw)
    out = torch.cat([head, tail], 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def test_a_decayed_call_runs_the_torch_form_whatever_the_backend(monkeypatch):
    """fla's linear-attention kernel has no decay: with ``log_decay`` the chunked form never
    dispatches to it (not even with backend=fla, which would refuse a CPU tensor otherwise)."""
    import attn2ssm.ops.linear_attention as ops

    monkeypatch.setattr(
        ops, "resolve_backend", lambda *a, **k: pytest.fail("a decayed call asked for a kernel")
    )
    q, k, v = positive_qkv(l=20)
    want = linear_attention_quadratic(q, k, v, log_decay=LOG_DECAY)[0]
    for backend in ("fla", "auto"):
        got, _ = linear_attention_chunked(q, k, v, chunk_size=8, log_decay=LOG_DECAY, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("decayed", [False, True])
def test_the_window_decode_step_equals_the_definition_token_by_token(window, decayed):
    """A prefill of window − 1 or more tokens, then one ``window_linear_attention_step`` per token:
    the definition's outputs (left padding included), the block form's final state; a state that is
    not yet full is refused."""
    q, k, v, fq, fk = window_inputs(seed=8)
    gamma = torch.tensor([0.3, 0.8])
    g = torch.log(torch.tensor([0.7, 0.95])) if decayed else None
    mask = left_padding(2, 13, [0, 5])  # row 1's padding reaches into the decoded tokens' windows
    kw = dict(scaling=0.5, window=window, gamma=gamma, eps=0.0, log_decay=g)
    ref = window_reference(q, k, v, fq, fk, 0.5, window, gamma, mask, log_decay=g)
    _, one_state = window_linear_attention(q, k, v, fq, fk, mask=mask, **kw)
    start = max(window - 1, 3)
    outs, state = window_linear_attention(
        *(t[:, :, :start] for t in (q, k, v, fq, fk)), mask=mask[:, :start], **kw
    )
    outs = [outs]
    for t in range(start, 13):
        y, state = window_linear_attention_step(
            *(x[:, :, t] for x in (q, k, v, fq, fk)), state, mask=mask[:, t], **kw
        )
        outs.append(y[:, :, None])
    torch.testing.assert_close(torch.cat(outs, 2), ref, atol=1e-5, rtol=1e-5)
    for name in ("kv", "k_sum", "keys", "values", "fkeys", "valid"):
        torch.testing.assert_close(getattr(state, name), getattr(one_state, name), atol=1e-5, rtol=1e-5)
    if window > 2:
        _, short = window_linear_attention(*(t[:, :, : window - 2] for t in (q, k, v, fq, fk)), **kw)
        with pytest.raises(ValueError, match=f"needs {window - 1} cached tokens"):
            window_linear_attention_step(*(x[:, :, 0] for x in (q, k, v, fq, fk)), short, **kw)
