"""CPU decode mode: one-token matmuls that use every core, and fused mixer input projections.

Decoding one token multiplies a (1, in) row by every weight matrix, so it is bound by how fast the
weights stream from memory. PyTorch's CPU backend (MKL) runs such a one-row product on ONE core:
~10-13 GB/s on the 2-core machine this project is measured on, where a plain reduction streams
~27 GB/s. Computing it as a batched matmul over ``p`` row blocks of the weight (p = the number of
threads) spreads the blocks over the cores: 1.3-2x faster for every weight shape of the built-in
teacher with the matrix in cache, ~1.5x when a whole model's weights stream from memory (13 vs
8-9 GB/s) (benchmarks/results/generate_speed.json is measured with it, for teacher and students
alike). The weight is only viewed as (p, out/p, in): same storage, same values, same layout.

``cpu_decode_layout(model)`` (in place, any ``nn.Module``: teacher or student):
- every ``nn.Linear`` becomes a ``DecodeLinear`` (a subclass with the same parameters and state
  dict) whose forward takes that route for up to 4 rows on CPU when autograd is off, and is
  ``F.linear`` otherwise (training, GPU, long prompts);
- a student mixer's input projections (q/k/v and the SSM's gate/Δ projections) become row blocks
  of one buffer (``fuse_input_linears``), read with one matmul at inference.
``undo_cpu_decode_layout(model)`` reverses both; a student's ``save_pretrained`` writes inside
``standard_layout`` (independent tensors while writing, fused again after).

This module is copied flat into exported checkpoints (``student/export.py``): import only torch
and the standard library.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 4  # beyond a few rows the product is a real GEMM and MKL parallelises it itself


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for at most MAX_ROWS rows on CPU without autograd, computed
    as a batched matmul over row blocks of ``weight`` so that every thread streams a block."""
    parts = torch.get_num_threads()
    out, width = weight.shape
    rows = x.numel() // width if width else 0
    if (
        parts < 2
        or rows == 0
        or rows > MAX_ROWS
        or out % parts
        or x.device.type != "cpu"
        or not weight.is_contiguous()
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        return F.linear(x, weight, bias)
    flat = x.reshape(1, rows, width).expand(parts, rows, width)
    y = torch.bmm(flat, weight.view(parts, out // parts, width).transpose(1, 2))  # (parts, rows, out/parts)
    y = y.transpose(0, 1).reshape(*x.shape[:-1], out)
    return y if bias is None else y + bias


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose few-row products on CPU use every core (see ``linear``); same
    parameters, state dict and results (to float rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _on_cpu(model: nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())


def _fuse(model: nn.Module) -> int:
    count = 0
    for module in model.modules():  # student mixers: the linears reading one input become one matmul
        fuse = getattr(module, "fuse_input_linears", None)
        if callable(fuse) and module.__dict__.get("_fused_inputs") is None and fuse():
            count += 1
    return count


def _unfuse(model: nn.Module) -> int:
    count = 0
    with torch.no_grad():
        for module in model.modules():
            fused = module.__dict__.pop("_fused_inputs", None)
            if fused is None:
                continue
            count += 1
            for lin in fused.linears:  # each parameter gets its own storage back
                lin.weight.data = lin.weight.data.clone()
                if lin.bias is not None:
                    lin.bias.data = lin.bias.data.clone()
    return count


@torch.no_grad()
def cpu_decode_layout(model: nn.Module) -> int:
    """Put ``model`` in CPU decode mode (see the module docstring). Returns how many modules
    changed; a no-op (0) off CPU or when already done."""
    if not _on_cpu(model):
        return 0
    count = _fuse(model)
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            count += 1
    return count


def undo_cpu_decode_layout(model: nn.Module) -> int:
    """Back to plain ``nn.Linear`` modules with independent weights. Returns how many modules changed."""
    count = _unfuse(model)
    for module in model.modules():
        if type(module) is DecodeLinear:
            module.__class__ = nn.Linear
            count += 1
    return count


@contextmanager
def standard_layout(model: nn.Module):
    """Independent parameter tensors inside the block (checkpoint writers refuse tensors that
    share memory); fused input projections are fused again on exit, even if the block raises."""
    had_fused = _unfuse(model) > 0
    try:
        yield
    finally:
        if had_fused:
            _fuse(model)
