"""The gated delta rule's forms held equal (fp32): materialised, chunked, sequential and step; with
padding and a carried state; the chunked form's gradients; the recurrence against its definition."""

import pytest
import torch
import torch.nn.functional as F

from attn2ssm.ops.gated_delta import (
    gated_delta_chunked,
    gated_delta_quadratic,
    gated_delta_sequential,
    gated_delta_step,
)
from op_forms import in_pieces


def _inputs(b=2, l=29, h=3, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, l, h, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, l, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, l, h, dv, generator=gen)
    g = -torch.rand(b, l, h, generator=gen) * 0.5
    g[:, min(3, l - 1)] = 0.0  # no decay at one token
    beta = torch.rand(b, l, h, generator=gen)
    state = torch.randn(b, h, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _padding(b, l):
    m = torch.ones(b, l)
    m[0, :5] = 0  # left padding in the first row
    return m


def test_step_is_the_definition():
    """S_t = S_{t-1} α (I − β k kᵀ) + β v kᵀ, o = scale · S_t q, with H = Sᵀ."""
    q, k, v, g, beta, state = _inputs(b=1, l=1, h=1)
    S = state[0, 0].T  # (dv, dk)
    kk, qq, vv = k[0, 0, 0], q[0, 0, 0], v[0, 0, 0]
    a, bt = torch.exp(g[0, 0, 0]), beta[0, 0, 0]
    S_new = S @ (a * (torch.eye(8) - bt * torch.outer(kk, kk))) + bt * torch.outer(vv, kk)
    o, h = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, scale=0.7)
    torch.testing.assert_close(h[0, 0], S_new.T)
    torch.testing.assert_close(o[0, 0], 0.7 * S_new @ qq)


def test_a_key_written_with_beta_one_is_replaced():
    """The delta rule's point: writing v under k with β = 1 overwrites what k held (no decay)."""
    dk = 4
    k = F.normalize(torch.ones(1, 1, dk), dim=-1)
    old, new = torch.tensor([[[1.0, 2, 3, 4]]]), torch.tensor([[[-5.0, 0, 5, 1]]])
    _, h = gated_delta_step(k, k, old, torch.zeros(1, 1), torch.ones(1, 1), scale=1.0)
    o, h = gated_delta_step(k, k, new, torch.zeros(1, 1), torch.ones(1, 1), h, scale=1.0)
    torch.testing.assert_close(o, new)


# the chunked form's two schedules (a loop of blocks: the CPU's; every block at once: CUDA's)
SCHEDULES = pytest.mark.parametrize("at_once", [False, True], ids=["block-loop", "at-once"])


@SCHEDULES
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 8, 64])
def test_forms_agree(padded, with_state, chunk, at_once):
    q, k, v, g, beta, state = _inputs()
    mask = _padding(2, 29) if padded else None
    s0 = state if with_state else None
    ref, ref_state = gated_delta_sequential(q, k, v, g, beta, mask, s0)
    out, out_state = gated_delta_chunked(q, k, v, g, beta, mask, s0, chunk_size=chunk, blocks_at_once=at_once)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_state, ref_state, atol=1e-5, rtol=1e-5)
    quad, quad_state = gated_delta_quadratic(q, k, v, g, beta, mask, s0)
    torch.testing.assert_close(quad, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(quad_state, ref_state, atol=1e-5, rtol=1e-5)
    if padded:
        assert out[0, :5].abs().max() == 0


@SCHEDULES
def test_padding_leaves_the_state_alone(at_once):
    q, k, v, g, beta, state = _inputs(b=1)
    mask = torch.zeros(1, 29)
    _, s = gated_delta_chunked(q, k, v, g, beta, mask, state, chunk_size=8, blocks_at_once=at_once)
    torch.testing.assert_close(s, state)


def test_the_matrix_maps_v_to_o():
    q, k, v, g, beta, _ = _inputs()
    mask = _padding(2, 29)
    o, _, M = gated_delta_quadratic(q, k, v, g, beta, mask, return_matrix=True)
    o_from_m = torch.einsum("bhts,bshd->bthd", M, v)
    torch.testing.assert_close(o_from_m, o, atol=1e-5, rtol=1e-5)
    assert torch.triu(M, 1).abs().max() == 0  # causal
    assert M[0, :, :5].abs().max() == 0 and M[0, :, :, :5].abs().max() == 0  # padded rows and columns


@SCHEDULES
def test_pieces_with_a_carried_state_equal_one_pass(at_once):
    q, k, v, g, beta, _ = _inputs()
    full, full_state = gated_delta_chunked(q, k, v, g, beta, chunk_size=8, blocks_at_once=at_once)
    pieces, s = in_pieces(
        lambda t, s: gated_delta_chunked(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state=s, chunk_size=8, blocks_at_once=at_once
        ),
        [7, 8, 20, 29, 29],
    )
    torch.testing.assert_close(pieces, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, full_state, atol=1e-5, rtol=1e-5)


@SCHEDULES
def test_chunked_gradients_equal_the_sequential_ones(at_once):
    inputs = [t.clone().requires_grad_() for t in _inputs(l=21)[:5]]
    twins = [t.detach().clone().requires_grad_() for t in inputs]
    weights = torch.randn(2, 21, 3, 6)
    (gated_delta_chunked(*inputs, chunk_size=8, blocks_at_once=at_once)[0] * weights).sum().backward()
    (gated_delta_sequential(*twins)[0] * weights).sum().backward()
    for a, b in zip(inputs, twins):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


@SCHEDULES
def test_half_precision_inputs_compute_in_fp32(at_once):
    q, k, v, g, beta, _ = _inputs()
    out, _ = gated_delta_chunked(q.half(), k.half(), v.half(), g, beta, chunk_size=8, blocks_at_once=at_once)
    ref, _ = gated_delta_chunked(
        q.half().float(), k.half().float(), v.half().float(), g, beta, chunk_size=8, blocks_at_once=at_once
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_the_cpu_default_is_the_block_loop(monkeypatch):
    """On a CPU tensor the chunked form loops over blocks (faster there: their tensors stay in cache);
    every block at once is asked for explicitly (it is CUDA's default)."""
    import attn2ssm.ops.gated_delta as ops

    ran = []
    for name in ("_block", "_blocks_at_once"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _n=name, _r=real, **kw: ran.append(_n) or _r(*a, **kw))
    q, k, v, g, beta, _ = _inputs()
    gated_delta_chunked(q, k, v, g, beta, chunk_size=8)
    assert set(ran) == {"_block"} and len(ran) == 4  # 29 tokens: 4 blocks of 8
    ran.clear()
    gated_delta_chunked(q, k, v, g, beta, chunk_size=8, blocks_at_once=True)
    assert ran == ["_blocks_at_once"]
