"""Bidirectional selective scan (Vim): two causal chunked scans = the closed-form quadratic reference."""

import torch

from attn2ssm.ops.bidirectional import bidirectional_scan_chunked, bidirectional_scan_quadratic
from attn2ssm.ops.selective_scan import selective_scan_quadratic


def _direction(b, l, g, p, n, seed, D=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, g, p, generator=gen)
    dt = torch.rand(b, l, g, p, generator=gen) * 0.5 + 0.05
    A = -torch.rand(g, p, n, generator=gen) * 2
    B, C = torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    return x, dt, A, B, C, (torch.randn(g, p, generator=gen) if D else None)


def test_chunked_equals_quadratic():
    fw, bw = _direction(2, 13, 2, 3, 4, 0), _direction(2, 13, 2, 3, 4, 1)
    ref = bidirectional_scan_quadratic(fw, bw)
    for chunk in (1, 4, 64):
        torch.testing.assert_close(
            bidirectional_scan_chunked(fw, bw, chunk_size=chunk, backend="torch"), ref, atol=1e-5, rtol=1e-5
        )


def test_matrices_triangular_and_forward_matches_causal_op():
    fw, bw = _direction(1, 7, 1, 2, 3, 2, D=False), _direction(1, 7, 1, 2, 3, 3, D=False)
    _, (Wf, Wb) = bidirectional_scan_quadratic(fw, bw, return_matrix=True)
    assert torch.equal(Wf, Wf.tril()) and torch.equal(Wb, Wb.triu())
    _, W_causal = selective_scan_quadratic(*fw[:5], return_matrix=True)
    torch.testing.assert_close(Wf, W_causal, atol=1e-6, rtol=1e-5)
    # the backward matrix of a sequence is the forward matrix of the flipped sequence, flipped
    flipped = tuple(t.flip(1) if t.dim() == 4 and t.shape[1] == 7 else t for t in bw[:5])
    _, W_flip = selective_scan_quadratic(*flipped, return_matrix=True)
    torch.testing.assert_close(Wb, W_flip.flip(-1, -2), atol=1e-6, rtol=1e-5)


def test_gradients_match():
    fw, bw = _direction(1, 9, 1, 4, 2, 4), _direction(1, 9, 1, 4, 2, 5)
    grads = []
    for fn in (
        bidirectional_scan_quadratic,
        lambda f, b: bidirectional_scan_chunked(f, b, chunk_size=4, backend="torch"),
    ):
        ins = [tuple(t.clone().requires_grad_(True) for t in d) for d in (fw, bw)]
        fn(*ins).square().sum().backward()
        grads.append([t.grad for d in ins for t in d])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
