"""Fused reads of a module's own linear layers: their weights made row blocks of one buffer, so
that an inference step reads several projections with ONE matmul (values unchanged, no extra
memory, the layers keep their parameters, names, state dict and LoRA targets).

``cpu_decode_layout`` (layout.py) fuses a student mixer's input projections (read by its
decode-mode class, mixers.py) and the teacher family's gated MLPs. A fusion is used only while it
still holds (``valid``: every layer still its owner's, of the class it had, hook-free, every
parameter where it was put). Inside a compiled decode step's trace the check is skipped (storage
pointers cannot be traced): the step checks every fusion just before its call, and the products
then run as ``_row_parts`` row blocks, the number the step keeps on each decode-mode module
(``row_parts``).

Decode-mode classes that ``attn2ssm.decode`` swaps in name the class they stand for in
``_decode_base`` (its ``DecodeLinear`` says ``nn.Linear``; ``decode_class`` makes the others): that
is how ``is_plain_linear`` knows one without importing it, and how ``undo_cpu_decode_layout``
puts every module's own class back.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

import torch
from torch import nn

from attn2ssm.ops.rows import MEMO_KEY, block_linear, rows_linear

# ``module.__dict__`` keys under which modules keep fusions (objects with valid / release / rebuild)
FUSION_KEYS = ("_fused_inputs", "_fused_maps")
# A fused buffer's rows are padded (zeros) to a multiple of lcm(this, threads): the row-block product
# needs its rows to split evenly over the threads, else it falls back to MKL's one-core product. A
# Mamba-2 mixer's q|k|v|gate|Δ rows number 1545 on the built-in teacher: unpadded, its fused read
# was the slowest product of a decode step (333 us a layer, one core; 2 threads, quiet 2-core CPU).
ROW_MULTIPLE = 8


@functools.cache  # one decode-mode class per (mixin, class): a memo of types
def decode_class(mixin: type, cls: type, same_name: bool = False) -> type:
    """``cls`` with ``mixin`` in front: the class a module of ``cls`` gets in decode mode.
    ``same_name``: it keeps ``cls``'s name and module (a model's: transformers writes the class
    name into a saved config's ``architectures``)."""
    attrs = {"_decode_base": cls}
    if same_name:
        attrs.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
    return type(cls.__name__ if same_name else f"Decode{cls.__name__}", (mixin, cls), attrs)


def is_plain_linear(module) -> bool:
    """An ``nn.Linear`` itself, or a decode-mode class standing for it (not a subclass someone
    wrapped it in)."""
    cls = module.__class__
    return cls is nn.Linear or (
        cls.__mro__[1] is nn.Linear and getattr(cls, "_decode_base", None) is nn.Linear
    )


def row_parts(module: nn.Module) -> int:
    """Row blocks a compiled decode step's products use for ``module`` (0: a plain product)."""
    return module.__dict__.get("_row_parts", 0)


def call_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; for a hook-free plain linear its forward without the module call (a decode
    step makes ~150 of them: the call's bookkeeping is a cost)."""
    if is_plain_linear(module) and not (module._forward_hooks or module._forward_pre_hooks):
        return module.forward(x)
    return module(x)


def fusion_holds(fusion) -> bool:
    """Is ``fusion`` (None: none) there and valid? Inside a compiled step's trace, yes whenever
    it is there: the step checked it just before its call."""
    return fusion is not None and (torch.compiler.is_compiling() or fusion.valid())


class FusedLinears:
    """Linear layers of ``owner`` that read the same input, their weights and biases made row
    blocks of one (Σout + pad, in) buffer (``pad`` zero rows make the row count divide evenly over
    the threads, see ROW_MULTIPLE), so that a step reads them with ONE matmul. The layers keep
    their own parameters (names, state dict, LoRA targets): the fused path is used only while
    every layer is still ``owner``'s and every parameter still lives where it was put (a
    replaced or wrapped layer, a re-assigned ``.data``, a hook or another class turns it off)."""

    def __init__(self, owner: nn.Module, names: list[str], linears: list[nn.Linear]):
        self.owner, self.names, self.linears = owner, names, linears
        self.sizes = [lin.out_features for lin in linears]
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)make the shared buffer from the layers' current parameters."""
        linears = self.linears
        self.__dict__.pop(MEMO_KEY, None)
        self.rows = rows = sum(self.sizes)
        pad = (-rows) % math.lcm(ROW_MULTIPLE, torch.get_num_threads())
        with torch.no_grad():
            first = linears[0].weight
            # (Σout + pad, in)
            self.weight = torch.cat(
                [lin.weight for lin in linears] + [first.new_zeros(pad, first.shape[1])], dim=0
            )
            self.bias = None
            if any(lin.bias is not None for lin in linears):
                parts = [
                    lin.bias if lin.bias is not None else self.weight.new_zeros(n)
                    for lin, n in zip(linears, self.sizes)
                ]
                self.bias = torch.cat(parts + [self.weight.new_zeros(pad)])
            start = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight.data = self.weight[start : start + n]
                if lin.bias is not None:
                    lin.bias.data = self.bias[start : start + n]
                start += n
        self.classes = [lin.__class__ for lin in linears]
        self.pointers = [
            (lin.weight.data_ptr(), None if lin.bias is None else lin.bias.data_ptr()) for lin in linears
        ]

    def valid(self) -> bool:
        """Does the fusion still hold?"""
        modules = self.owner._modules
        for name, lin, cls, (w, b) in zip(self.names, self.linears, self.classes, self.pointers):
            if (
                modules.get(name) is not lin
                or lin.__class__ is not cls
                or lin._forward_hooks
                or lin._forward_pre_hooks
            ):
                return False
            params = lin._parameters  # (not lin.weight: nn.Module.__getattr__ is slow on a hot path)
            if params["weight"].data_ptr() != w or (b is not None and params["bias"].data_ptr() != b):
                return False
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side: (..., Σout) (a view: the padding's columns left out)."""
        if torch.compiler.is_compiling():
            y = rows_linear(x, self.weight, self.bias, row_parts(self.owner))
        else:
            y = block_linear(x, self.weight, self.bias, self.__dict__)
        return y.narrow(-1, 0, self.rows)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split(self.sizes, dim=-1)

    def release(self) -> None:
        """Each parameter gets its own storage back."""
        self.__dict__.pop(MEMO_KEY, None)
        for lin in self.linears:
            lin.weight.data = lin.weight.data.clone()
            if lin.bias is not None:
                lin.bias.data = lin.bias.data.clone()


class ParamStack:
    """Parameters of equal trailing shape made consecutive blocks (along dim 0) of one buffer, so
    that a step reads them as one tensor (e.g. a mixer's query and key feature maps); values
    unchanged, no extra memory. ``valid()`` while every parameter still lives where it was put."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.rebuild()

    def rebuild(self) -> None:
        with torch.no_grad():
            self.buffer = torch.cat([p.data for p in self.params], dim=0)
            start = 0
            for p in self.params:
                p.data = self.buffer[start : start + p.shape[0]]
                start += p.shape[0]
        self.pointers = [p.data_ptr() for p in self.params]

    def valid(self) -> bool:
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.pointers))

    def release(self) -> None:
        for p in self.params:
            p.data = p.data.clone()


def drop_fusions(module: nn.Module) -> None:
    """Forget ``module``'s fusions (their buffers would pin the old storage after a ``.to()``)."""
    for key in FUSION_KEYS:
        module.__dict__.pop(key, None)


def release_fusions(model: nn.Module) -> list[tuple[nn.Module, str, object]]:
    """Every fusion in ``model`` released (independent parameter tensors) and removed; returns
    (module, key, fusion) for each, which ``rebuild`` can put back."""
    found = []
    with torch.no_grad():
        for module in model.modules():
            module.__dict__.pop(MEMO_KEY, None)  # a kept view of a fused buffer would pin it
            for key in FUSION_KEYS:
                fusion = module.__dict__.pop(key, None)
                if fusion is not None:
                    fusion.release()
                    found.append((module, key, fusion))
    return found


@contextmanager
def standard_layout(model: nn.Module):
    """Independent parameter tensors inside the block (checkpoint writers refuse tensors that
    share memory); the fusions are made again on exit, even if the block raises."""
    found = release_fusions(model)
    try:
        yield
    finally:
        for module, key, fusion in found:
            fusion.rebuild()
            module.__dict__[key] = fusion
