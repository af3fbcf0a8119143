"""Causal depthwise conv: one pass == pieces with carried state == token-by-token step (fp32, 1e-6)."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.errors import ConfigError
from attn2ssm.ops.conv import SHORT, causal_conv1d, causal_conv1d_state, causal_conv1d_step
from op_forms import in_pieces, left_padding


def _inputs(b=2, l=13, c=5, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, l, c, generator=g), torch.randn(c, k, generator=g), torch.randn(c, generator=g)


def test_matches_nn_conv1d_definition():
    """Tap k-1 is the current token: the same as nn.Conv1d(groups=c, padding=k-1) cut to l."""
    x, w, bias = _inputs()
    y, state = causal_conv1d(x, w, bias)
    ref = F.conv1d(x.transpose(1, 2), w[:, None, :], bias, padding=3, groups=5)[..., :13].transpose(1, 2)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))


@pytest.mark.parametrize("l", [1, 5, SHORT, SHORT + 1, 40])
def test_both_forms_match_nn_conv1d_with_a_state(l):
    """Short inputs take the unfolded-window sum, longer ones oneDNN's conv: both equal the
    definition, continuing from a carried state."""
    x, w, bias = _inputs(l=l)
    state = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1))
    y, new_state = causal_conv1d(x, w, bias, state=state, activation="silu")
    full = torch.cat([state, x.transpose(1, 2)], -1)
    ref = F.silu(F.conv1d(full, w[:, None, :], bias, groups=5)).transpose(1, 2)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_state, full[..., -3:])


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_pieces_and_steps_equal_one_pass_with_padding(activation, k):
    x, w, bias = _inputs(k=k)
    mask = left_padding(2, 13, [0, 4])
    full, full_state = causal_conv1d(x, w, bias, mask=mask, activation=activation)
    # pieces, including ones shorter than k-1 (the old state must shift, not be replaced)
    pieces, state = in_pieces(
        lambda t, s: causal_conv1d(x[:, t], w, bias, state=s, mask=mask[:, t], activation=activation),
        [1, 3, 8, 9, 13],
    )
    torch.testing.assert_close(pieces, full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, full_state, atol=0, rtol=0)
    # token by token; the step has no mask, so padded inputs are zeroed by the caller
    xm = x * mask[..., None]
    state, outs = None, []
    for t in range(13):
        y, state = causal_conv1d_step(xm[:, t], w, bias, state, activation=activation)
        outs.append(y)
    torch.testing.assert_close(torch.stack(outs, 1), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, full_state, atol=0, rtol=0)
    assert full_state.shape == (2, 5, k - 1)


def test_padded_inputs_are_zeroed():
    """Left padding: the real tokens' outputs equal those of the unpadded sequence."""
    x, w, bias = _inputs()
    mask = left_padding(2, 13, [0, 4])
    x_junk = x.clone()
    x_junk[1, :4] = 1e3  # whatever sits under the padding must not leak
    y, state = causal_conv1d(x_junk, w, bias, mask=mask)
    y_real, state_real = causal_conv1d(x[1:, 4:], w, bias)
    torch.testing.assert_close(y[1, 4:], y_real[0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(state[1], state_real[0])


def test_state_holds_last_inputs_when_l_shorter_than_window():
    x, w, _ = _inputs(l=2, k=4)
    s0 = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    _, s1 = causal_conv1d(x, w, state=s0)
    torch.testing.assert_close(s1, torch.cat([s0[..., 2:], x.transpose(1, 2)], -1), atol=0, rtol=0)


def test_bf16_in_bf16_out_and_grads():
    x, w, bias = _inputs()
    y, state = causal_conv1d(x.bfloat16(), w, bias, activation="silu")
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    x.requires_grad_(True)
    w.requires_grad_(True)
    causal_conv1d(x, w, bias)[0].sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_bad_arguments():
    x, w, bias = _inputs()
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, w, bias, activation="gelu")
    with pytest.raises(ConfigError, match="backend='triton' is not a kernel choice"):
        causal_conv1d(x, w, bias, backend="triton")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_state_alone_equals_the_step_at_every_position(k):
    """``causal_conv1d_state`` over the first t tokens (every t), from a carried state, with left
    padding, equals the state ``causal_conv1d_step`` reaches token by token."""
    x, w, bias = _inputs(l=7, k=k)
    mask = left_padding(2, 7, [0, 3])
    start = torch.randn(2, 5, k - 1, generator=torch.Generator().manual_seed(2))
    xm, stepped = x * mask[..., None], start
    for t in range(8):
        got = causal_conv1d_state(x[:, :t], k, state=start, mask=mask[:, :t])
        torch.testing.assert_close(got, stepped, atol=0, rtol=0)
        if t < 7:
            _, stepped = causal_conv1d_step(xm[:, t], w, bias, stepped)
