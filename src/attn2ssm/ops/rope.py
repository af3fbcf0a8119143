"""Rotary position embedding, one implementation for every family (teachers' adapters and students).

Every supported family uses the rotate-half (GPT-NeoX) convention; Phi and GPT-NeoX rotate
only the leading ``rotary_dim`` dims of each head. Adapters and students share this function
so a student's RoPE is bit-for-bit the teacher's.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dim, split in halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of each head; the rest pass through unchanged.

    x: (b, h, l, d); cos, sin: (b, l, rotary_dim) as the model's rotary_emb returns them,
    or (l, rotary_dim). ``rotary_dim == 0`` means no RoPE (x is returned as is).
    """
    if rotary_dim == 0:
        return x
    if cos.shape[-1] != rotary_dim or sin.shape[-1] != rotary_dim:
        raise ValueError(f"cos/sin have {cos.shape[-1]} dims, expected rotary_dim={rotary_dim}")
    if cos.dim() == 3 and x.dim() == 4:  # (b, l, r) -> (b, 1, l, r): same angle for every head
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + rotate_half(x_rot) * sin
    return torch.cat((x_rot, x_pass), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """(s1, s2) -> (−s1, s2) over the last dim: rotate_half(x)·sin == swap_halves(x)·signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_full(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed: torch.Tensor | None = None
) -> torch.Tensor:
    """``apply_rotary`` when every dim rotates, in a few small ops (the decode step's form):
    x (..., d) with cos, sin broadcasting against it; rotate_half(x)·sin is computed as
    swap_halves(x)·signed_sin(sin), the same products exactly. ``signed``: signed_sin(sin) when
    the caller already has it (one per forward, shared by every layer)."""
    half = x.shape[-1] // 2
    if signed is None:
        signed = signed_sin(sin)
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), signed)
