"""int8 weight-only linear: per-channel quantisation round-trips within half a step, and the int8
kernel (aten._weight_int8pack_mm) computes what the dequantised float32 weight computes."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.ops.quant import (
    dequantize_per_channel_int8,
    int8_linear,
    int8_linear_reference,
    quantize_per_channel_int8,
)


def _weight(out=48, width=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different size
    w = torch.randn(out, width, generator=g) * torch.logspace(-3, 1, out)[:, None]
    w[3] = 0.0  # an all-zero row
    return w


def test_quantize_round_trip_within_half_a_step_per_row():
    w = _weight()
    q, scales = quantize_per_channel_int8(w)
    assert (
        q.dtype == torch.int8
        and q.shape == w.shape
        and scales.shape == (w.shape[0],)
        and scales.dtype == torch.float32
    )
    assert int(q.abs().max()) == 127  # the largest element of a row lands on ±127
    err = (dequantize_per_channel_int8(q, scales) - w).abs()
    assert bool((err <= scales[:, None] / 2 + 1e-7 * w.abs()).all())
    assert bool((q[3] == 0).all()) and scales[3] == 1.0  # no division by zero
    # per channel, not per tensor: the small rows keep their relative precision
    small = w[:8].abs().amax(1)
    assert bool((err[:8].amax(1) <= small / 254 + 1e-9).all())


def test_quantize_rejects_a_non_matrix():
    with pytest.raises(ValueError, match="out, in"):
        quantize_per_channel_int8(torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_int8_linear_matches_the_dequantised_float32_reference(dtype, rows):
    w = _weight(out=64, width=96)
    q, scales = quantize_per_channel_int8(w)
    bias = torch.randn(64)
    x = torch.randn(2, rows, 96).to(dtype)
    y = int8_linear(x, q, scales, bias.to(dtype))
    # not the int8 weight: the quantisation shows beside the kernel's rounding
    exact = F.linear(x.float(), w, bias)
    assert (y.float() - exact).abs().max() > 0
    ref = F.linear(x.float(), q.float() * scales[:, None], bias)  # float32, weight dequantised
    assert y.dtype == dtype and y.shape == (2, rows, 64)
    # the kernel takes bfloat16 activations and scales (float32 ones are rounded for it: its float32
    # path is ~20x slower) and rounds its output to bfloat16: 8-bit mantissas, ~2^-9 relative each
    tol = 2e-2
    assert (y.float() - ref).abs().max() <= tol * (1 + ref.abs().max())
    assert int8_linear_reference(x, q, scales, bias).dtype == dtype


def test_int8_linear_is_close_to_the_float_weight():
    """Quantisation error against the unquantised weight: small for a well-spread weight."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(256, 512, generator=g) * 0.02
    x = torch.randn(4, 512, generator=g)
    q, scales = quantize_per_channel_int8(w)
    y, exact = int8_linear(x, q, scales), F.linear(x, w)
    rel = (y - exact).norm() / exact.norm()
    assert 1e-4 < rel < 2e-2  # it is quantised (not a float copy), and within ~1 %
