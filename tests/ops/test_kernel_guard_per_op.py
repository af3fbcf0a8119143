"""fla's Hopper gated-backward fault (fla issue #640) judged per op and dtype (ops/kernels.py), with
the GPU, Triton and TileLang faked: TileLang takes the gated delta rule's backward in any dtype but
SSD's only in fp32 (SSD keeps its chunk states fp32, which fla's TileLang verifier refuses beside
16-bit inputs); the gated delta rule trains through fla's padded path where the fault is, SSD
through the PyTorch form."""

import pytest
import torch

import attn2ssm.ops.fla as fla_ops
from attn2ssm.ops import kernels

HOPPER_BAD_TRITON = ((9, 0), (3, 6, 0))


@pytest.fixture
def gpu(monkeypatch):
    """A function (capability, triton, tilelang) → the machine faked as that."""
    monkeypatch.setattr(kernels, "_GATED_CHECKED", {})

    def fake(capability, triton, tilelang):
        monkeypatch.setattr(kernels, "_capability", lambda device: capability)
        monkeypatch.setattr(kernels, "_triton_version", lambda: triton)
        monkeypatch.setattr(kernels, "_tilelang_ready", lambda: tilelang)

    return fake


@pytest.mark.parametrize(
    ("op", "dtype", "tilelang", "wrong"),
    [
        ("gated_delta", torch.bfloat16, True, False),  # TileLang takes it
        ("gated_delta", torch.float32, True, False),
        ("gated_delta", torch.bfloat16, False, True),  # no TileLang: fla refuses
        ("ssd", torch.bfloat16, True, True),  # TileLang rejects SSD under bf16: the fault stands
        ("ssd", torch.float16, True, True),
        ("ssd", torch.float32, True, False),  # fp32 states beside fp32 inputs: TileLang takes it
        ("ssd", torch.float32, False, True),
    ],
)
def test_tilelang_clears_the_fault_per_op_and_dtype(gpu, op, dtype, tilelang, wrong):
    gpu(*HOPPER_BAD_TRITON, tilelang)
    problem = kernels.fla_gated_backward_problem(torch.device("cuda", 0), op, dtype)
    assert (problem is not None) == wrong
    if wrong:
        assert "fla issue #640" in problem
    assert kernels.gated_delta_pads_keys(torch.device("cuda", 0), dtype) == (not tilelang)


def test_no_fault_off_hopper_or_with_a_fixed_triton(gpu):
    for capability, triton in (((8, 0), (3, 6, 0)), ((9, 0), (3, 7, 1)), ((10, 0), (3, 5, 0))):
        gpu(capability, triton, False)
        kernels._GATED_CHECKED.clear()
        for op in kernels.GATED_OPS:
            assert kernels.fla_gated_backward_problem(torch.device("cuda", 0), op, torch.bfloat16) is None
        assert not kernels.gated_delta_pads_keys(torch.device("cuda", 0), torch.bfloat16)
    with pytest.raises(ValueError, match="not one of"):
        kernels._tilelang_takes_over("mamba1", None)


def test_training_routes_per_op(gpu, monkeypatch):
    """Where the fault stands: a differentiated gated delta rule call keeps fla (padded), SSD's goes
    to the PyTorch form unless TileLang takes it (fp32); under autocast SSD is judged at the
    autocast dtype (TileLang present, yet it refuses SSD's bf16 backward)."""
    from types import SimpleNamespace

    monkeypatch.delenv("ATTN2SSM_KERNELS", raising=False)
    monkeypatch.setattr(kernels, "fla_problem", lambda: None)
    monkeypatch.setattr(kernels, "_WARNED", set())
    gpu(*HOPPER_BAD_TRITON, True)
    fp32 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32, is_cuda=True)
    bf16 = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, is_cuda=True)
    assert kernels.resolve_backend("auto", bf16, gated_backward=True, op="gated_delta") == "fla"
    assert kernels.resolve_backend("auto", fp32, gated_backward=True, op="ssd") == "fla"  # TileLang takes it
    with pytest.warns(RuntimeWarning, match="fla issue #640"):
        assert kernels.resolve_backend("auto", bf16, gated_backward=True, op="ssd") == "torch"
    assert kernels.resolve_backend("auto", bf16, op="ssd") == "fla"  # inference keeps fla
    assert kernels.resolve_backend("auto", bf16, gated_backward=True) == "torch"  # no op named: cautious
    seen = []
    monkeypatch.setattr(kernels, "fla_gated_backward_problem", lambda device, op, dtype: seen.append(dtype))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kernels.resolve_backend("auto", torch.zeros(2), gated_backward=True, op="ssd")
    assert seen == [torch.bfloat16]


def test_the_padding_switch_follows_the_fault(monkeypatch):
    """ops/fla.py pads d_k only for a call that will be differentiated, where the fault is (or when
    the switch forces it, as the CPU tests do)."""
    q = torch.zeros(1, 2, 1, 64)
    monkeypatch.setattr(fla_ops, "PAD_GATED_KEYS", None)
    monkeypatch.setattr(kernels, "gated_delta_pads_keys", lambda device, dtype: True)
    assert fla_ops._pads_keys(q, trains=True) and not fla_ops._pads_keys(q, trains=False)
    monkeypatch.setattr(kernels, "gated_delta_pads_keys", lambda device, dtype: False)
    assert not fla_ops._pads_keys(q, trains=True)
    monkeypatch.setattr(fla_ops, "PAD_GATED_KEYS", True)
    assert fla_ops._pads_keys(q, trains=True) and not fla_ops._pads_keys(q, trains=False)
