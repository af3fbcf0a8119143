"""Which device a command's models run on: ``--device`` (``cpu``, ``cuda``, ``cuda:N``), default
CUDA where torch sees a GPU, else the CPU. (Training picks its device through the recipe's
``device`` key and accelerate: distill/trainer.py.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attn2ssm.errors import ConfigError

if TYPE_CHECKING:
    import torch


def resolve_device(requested: str | None, flag: str = "--device") -> torch.device:
    """``requested`` (None or "auto": CUDA when available, else the CPU) as a torch device; a name
    torch does not know, or a GPU where torch sees none, is a one-line ConfigError."""
    import torch  # heavy: torch

    if requested in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    return device
