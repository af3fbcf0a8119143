"""CPU decode layout: store wide Linear weights column-major so one-token matmuls run faster.

Decoding one token multiplies a (1, in) row by every weight matrix: it is bound by how fast the
weights stream from memory. On x86 CPUs with PyTorch's MKL backend the (1, in) @ W^T product of
a row-major ``nn.Linear`` weight W (out, in) with out > in (MLP gate/up, Mamba in-projections,
the LM head) streams at ~10 GB/s on one core, while the same product with W stored column-major
(W^T contiguous) streams at ~17-20 GB/s (benchmarks/results/generate_speed.json records the
effect per model). Square and narrowing (out < in) weights are as fast or faster row-major, so
they are left alone.

``cpu_decode_layout(model)`` re-strides those weights in place: same values, same shapes, same
``Parameter`` objects (tied embeddings stay tied), no extra memory once the old storage is freed.
Every PyTorch op accepts the strided weight. Saving needs row-major tensors: a student's
``save_pretrained`` saves inside ``standard_layout`` (row-major while writing, column-major again
after); call ``contiguous_weights(model)`` before saving a re-strided teacher with HF's own
``save_pretrained``. Applies to any ``nn.Module`` — a teacher or a student — so speed
comparisons can give both the same layout.

This module is copied flat into exported checkpoints (``student/export.py``): import only torch
and the standard library.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def _wide_linears(model: nn.Module):
    seen = set()
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.out_features > module.in_features:
            w = module.weight
            if id(w) not in seen:  # a tied weight is re-strided once
                seen.add(id(w))
                yield w


@torch.no_grad()
def cpu_decode_layout(model: nn.Module) -> int:
    """Store every Linear weight with out_features > in_features column-major (in place, values
    unchanged) and fuse each student mixer's input projections (``fuse_input_linears``: q/k/v and
    the SSM's gate/Δ projections become views of one column-major buffer). Returns how many
    weights/groups changed. A no-op off CPU."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return 0
    count = 0
    for module in model.modules():  # mixers: the linears reading one input become one matmul
        fuse = getattr(module, "fuse_input_linears", None)
        if callable(fuse) and not getattr(module, "_fused_inputs", None) and fuse():
            count += 1
    for w in _wide_linears(model):
        if w.dim() == 2 and w.is_contiguous():  # fused views are already column-major
            w.data = w.data.t().contiguous().t()
            count += 1
    return count


@torch.no_grad()
def contiguous_weights(model: nn.Module) -> int:
    """Undo ``cpu_decode_layout``: every non-contiguous parameter back to row-major. Returns the count."""
    count = 0
    for p in model.parameters():
        if not p.is_contiguous():
            p.data = p.data.contiguous()
            count += 1
    for module in model.modules():  # their fused buffers no longer hold the weights
        module.__dict__.pop("_fused_inputs", None)
    return count


@contextmanager
def standard_layout(model: nn.Module):
    """Row-major parameters inside the block (for writing checkpoints); a model that had the CPU
    decode layout gets it back on exit, even if the block raises."""
    had_layout = contiguous_weights(model) > 0
    try:
        yield
    finally:
        if had_layout:
            cpu_decode_layout(model)
