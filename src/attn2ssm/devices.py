"""Which device a command's models run on: ``--device`` (``cpu``, ``cuda``, ``cuda:N``), default
CUDA where torch sees a GPU, else the CPU. (Training picks its device through the recipe's
``device`` key and accelerate: distill/trainer.py.)

On CUDA, fp32 matrix products run as TF32 (``enable_tf32``: the PyTorch forms' fp32 matmuls and
convolutions, ~8× the fp32 rate on tensor cores, 10-bit mantissas on the inputs, fp32 sums): a
run's kernel choice (ops/kernels.py) and every ``--device`` resolved to CUDA turn it on, and the
run records it. ``ATTN2SSM_TF32=0`` keeps full fp32. Nothing changes on a CPU."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from attn2ssm.errors import ConfigError

if TYPE_CHECKING:
    import torch


TF32_ENV = "ATTN2SSM_TF32"


def enable_tf32(device_type: str) -> bool:
    """Let fp32 matmuls and cuDNN convolutions on CUDA use TF32 tensor cores (``ATTN2SSM_TF32=0``:
    not); returns whether they do. A no-op on a CPU (the flags would not apply there anyway)."""
    if device_type != "cuda" or os.environ.get(TF32_ENV) == "0":
        return False
    import torch  # heavy: torch

    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def resolve_device(requested: str | None, flag: str = "--device") -> torch.device:
    """``requested`` (None or "auto": CUDA when available, else the CPU) as a torch device; a name
    torch does not know, or a GPU where torch sees none, is a one-line ConfigError."""
    import torch  # heavy: torch

    if requested in (None, "", "auto"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        enable_tf32(device.type)
        return device
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"{flag} {requested!r} is not a device", "write cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{flag} {requested} asks for a GPU and torch sees none", f"drop {flag}, or write {flag} cpu"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            f"{flag} {requested}: this machine has {torch.cuda.device_count()} CUDA device(s)",
            f"use {flag} cuda:0 … cuda:{torch.cuda.device_count() - 1}",
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{flag} {requested}: attn2ssm runs on cpu or cuda", "write cpu, cuda or cuda:N")
    enable_tf32(device.type)
    return device
