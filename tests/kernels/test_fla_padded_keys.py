"""The gated delta rule's padded path (ops/fla.py, ``PAD_GATED_KEYS``): fla's gated chunk backward is
wrong on Hopper under Triton 3.4–3.7.0 for 64-wide key tiles (fla issue #640), our GDN's d_k; the
adapter zero-pads q / k to d_k 128 (128-wide tiles), keeps the true d_k's scale, slices the
gradients back, and runs fla's backward with fla's blanket refusal lifted for that call only.

Here: padded fla == unpadded fla == the PyTorch form (``gated_delta_chunked``), outputs, final
states and every input's gradient, with a carried state, left padding and a tail chunk; and, with
fla's Hopper guard faked on, the unpadded backward is refused by fla while the padded one runs and
agrees. Under the interpreter this is fp32 on the CPU; on a GPU (``ATTN2SSM_KERNEL_TESTS=cuda``)
it is the gradient-parity check the padded path stands behind.
"""

import pytest
import torch
import torch.nn.functional as F

import attn2ssm.ops.fla as fla_ops
from attn2ssm.ops.fla import gated_delta_fla
from attn2ssm.ops.gated_delta import gated_delta_chunked
from attn2ssm.ops.kernels import fla_gated_backward_problem

TOL = 5e-5  # fp32


def _inputs(seed: int, d_k: int = 64):
    g = torch.Generator().manual_seed(seed)
    b, l, h, d_v = 2, 20, 1, 8  # tiny: the interpreter is slow; 20 tokens, a part chunk
    q, k = (F.normalize(torch.randn(b, l, h, d_k, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(b, l, h, d_v, generator=g)
    decay, beta = -torch.rand(b, l, h, generator=g) * 0.3, torch.rand(b, l, h, generator=g)
    state = torch.randn(b, h, d_k, d_v, generator=g) * 0.5
    mask = torch.ones(b, l)
    mask[0, :3] = 0
    return (q, k, v, decay, beta), mask, state, g


def _run(form, tensors, mask, state, w, device):
    leaves = [t.detach().clone().to(device).requires_grad_() for t in tensors]
    s0 = state.detach().clone().to(device).requires_grad_()
    out, final = form(*leaves, mask.to(device), s0)
    ((out.float() * w.to(device)).sum() + final.float().sum()).backward()
    return out.float().cpu(), final.cpu(), [t.grad.cpu() for t in leaves] + [s0.grad.cpu()]


def _close(got, want, what):
    err = (got - want).abs().max().item()
    assert err <= TOL * max(1.0, want.abs().max().item()), f"{what}: max error {err:.3g}"


def _fla(padded: bool):
    def form(*args):
        fla_ops.PAD_GATED_KEYS = padded
        try:
            return gated_delta_fla(*args)
        finally:
            fla_ops.PAD_GATED_KEYS = None

    return form


def _torch_form(q, k, v, g, beta, mask, state):
    return gated_delta_chunked(q, k, v, g, beta, mask, state, chunk_size=8, backend="torch")


def test_padded_keys_equal_unpadded_fla_and_the_pytorch_form(device, monkeypatch):
    import fla.ops.gated_delta_rule as fla_gdr

    widths, real = [], fla_gdr.chunk_gated_delta_rule
    monkeypatch.setattr(
        fla_gdr, "chunk_gated_delta_rule", lambda q, *a, **kw: widths.append(q.shape[-1]) or real(q, *a, **kw)
    )
    tensors, mask, state, g = _inputs(0)
    w = torch.randn(2, 20, 1, 8, generator=g)
    want = _run(_torch_form, tensors, mask, state, w, "cpu")
    for padded in (False, True):
        if not padded and fla_gated_backward_problem(torch.device(device), "gated_delta", torch.float32):
            with pytest.raises(RuntimeError, match="#640"):  # a Hopper under Triton 3.4–3.7.0: fla refuses
                _run(_fla(padded), tensors, mask, state, w, device)
            continue
        got = _run(_fla(padded), tensors, mask, state, w, device)
        _close(got[0], want[0], f"output (padded={padded})")
        _close(got[1], want[1], f"final state (padded={padded})")
        for i, (a, b) in enumerate(zip(got[2], want[2])):
            assert a.shape == b.shape  # sliced back to the true d_k
            _close(a, b, f"gradient of input {i} (padded={padded})")
    assert widths == [64, 128]  # fla saw d_k 64 unpadded, 128 padded


def test_the_padded_path_outlives_fla_s_hopper_refusal(device, monkeypatch):
    """fla's guard faked on (a Hopper under Triton 3.6): fla refuses the unpadded gated backward;
    the padded call's backward runs (the refusal lifted for it alone) and equals the PyTorch form."""
    import fla.ops.common.chunk_o as chunk_o

    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    tensors, mask, state, g = _inputs(1)
    w = torch.randn(2, 20, 1, 8, generator=g)
    with pytest.raises(RuntimeError, match="#640"):
        _run(_fla(False), tensors, mask, state, w, device)
    got = _run(_fla(True), tensors, mask, state, w, device)
    assert chunk_o.TRITON_ABOVE_3_7_1 is False  # restored after the backward
    want = _run(_torch_form, tensors, mask, state, w, "cpu")
    _close(got[0], want[0], "output")
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        _close(a, b, f"gradient of input {i}")


def test_no_grad_calls_are_never_padded(device, monkeypatch):
    """Inference needs no padding (the fault is in the backward): the switch applies to calls that
    will be differentiated only; the output is the same either way."""
    tensors, mask, state, _ = _inputs(2, d_k=16)
    calls = []
    real = fla_ops._GuardLiftedBackward.apply
    monkeypatch.setattr(fla_ops._GuardLiftedBackward, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fla_ops, "PAD_GATED_KEYS", True)
    with torch.no_grad():
        out, _ = gated_delta_fla(*(t.to(device) for t in tensors), mask.to(device), state.to(device))
    assert calls == []
    want, _ = _torch_form(*tensors, mask, state)
    _close(out.float().cpu(), want, "output")


def test_the_padded_path_under_activation_checkpointing(device):
    """Training stages with ``gradient_checkpointing`` recompute each layer in the backward
    (non-reentrant checkpoints): the padded path's own graph must survive that, gradients equal."""
    from torch.utils.checkpoint import checkpoint

    tensors, mask, state, g = _inputs(3)
    w = torch.randn(2, 20, 1, 8, generator=g)
    plain = _run(_fla(True), tensors, mask, state, w, device)

    def recomputed(*args):
        return checkpoint(_fla(True), *args, use_reentrant=False)

    got = _run(recomputed, tensors, mask, state, w, device)
    _close(got[0], plain[0], "output")
    for i, (a, b) in enumerate(zip(got[2], plain[2])):
        _close(a, b, f"gradient of input {i}")
