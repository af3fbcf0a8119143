"""TF32 for the fp32 matmuls on CUDA (devices.enable_tf32): a no-op on a CPU, on with a (faked)
CUDA device, off with ATTN2SSM_TF32=0, and recorded in a run's kernel choice."""

import pytest
import torch

from attn2ssm import devices
from attn2ssm.ops import kernels


@pytest.fixture
def flags(monkeypatch):
    """TF32 flags reset to off for the test and restored after it; ATTN2SSM_TF32 unset."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    monkeypatch.delenv(devices.TF32_ENV, raising=False)
    yield lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_a_cpu_changes_nothing(flags):
    assert devices.enable_tf32("cpu") is False
    assert devices.resolve_device("cpu").type == "cpu"
    assert flags() == (False, False)


def test_a_cuda_device_turns_tf32_on(flags, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.enable_tf32("cuda") is False and flags() == (False, False)  # no GPU after all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert devices.resolve_device("cuda").type == "cuda"
    assert flags() == (True, True)


def test_the_environment_keeps_full_fp32(flags, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(devices.TF32_ENV, "0")
    assert devices.enable_tf32("cuda") is False and flags() == (False, False)


def test_a_run_records_tf32_in_its_kernel_choice(flags, monkeypatch):
    monkeypatch.delenv("ATTN2SSM_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "fla_problem", lambda: "fla does not import (faked)")
    choice = kernels.choose_kernels("auto", "cpu")
    assert choice.tf32 is False and "TF32" not in choice.describe() and flags() == (False, False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    choice = kernels.choose_kernels("auto", "cuda")
    assert choice.tf32 is True and choice.to_dict()["tf32"] is True
    assert choice.describe().endswith("; fp32 matmuls in TF32") and flags() == (True, True)
