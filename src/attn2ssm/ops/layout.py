"""CPU decode mode: one-token matmuls that use every core, fused projections, fewer ops per step.

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
  dict) whose forward takes that route for up to 4 rows on CPU when autograd is off (its
  row-block view kept between calls), and is ``F.linear`` otherwise (training, GPU, long prompts);
- a student mixer's input projections (q/k/v and the SSM's gate/Δ projections) become row blocks
  of one buffer (``fuse_input_linears``), read with one matmul at inference; a linear-attention
  mixer's query and key Hedgehog maps are stacked the same way;
- any model's gated MLPs (``down(act(gate(x)) * up(x))``) read gate and up with one matmul, and
  its RMSNorms run in four ops (float32, autograd off) — each only after a probe input
  showed the fused form computes what the module computes (Gemma's (1 + w) norm keeps its class);
- a student whose layers allow it gets a one-token ``DecodePlan`` (student/decode_plan.py);
  with ``compile=True`` the plan's layers also run as one ``torch.compile``d function
  (student/compiled_step.py; ``traced_parts`` below is how the traced code knows).
A decode step is bound by weight streaming AND by per-op overhead (~3-8 us a small op on the
2-core machine, ~40 small ops per layer): fewer ops per layer is as much of the gain as the
matmul route.
``undo_cpu_decode_layout(model)`` reverses all of it; a student's ``save_pretrained`` writes inside
``standard_layout`` (independent tensors while writing, fused again after). A ``.to()`` drops
the fused buffers (they would pin the old storage); call ``cpu_decode_layout`` again after it.

This module is copied flat into exported checkpoints (``student/export.py``): import only torch
and the standard library.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 4  # beyond a few rows the product is a real GEMM and MKL parallelises it itself

# Set by a compiled decode step (student/compiled_step.py) around each call: the row-block count
# its products use. Read only through ``traced_parts``.
_TRACED_PARTS = 0


def traced_parts() -> int:
    """Non-zero only while torch.compile traces a compiled decode step: the row-block count its
    products use, and the step's promise that it checked every fusion just before the call (so
    ``valid`` need not run inside: its storage-pointer checks cannot be traced). 0 in eager code,
    whatever ``_TRACED_PARTS`` holds, and in anyone else's traced code."""
    return _TRACED_PARTS if torch.compiler.is_compiling() else 0


@contextmanager
def tracing_parts(parts: int):
    """Inside the block a compiled step's trace sees ``traced_parts() == parts``; the compiled
    function guards on it, so a call outside the block would re-trace, never reuse."""
    global _TRACED_PARTS
    previous, _TRACED_PARTS = _TRACED_PARTS, parts
    try:
        yield
    finally:
        _TRACED_PARTS = previous


def _blocks(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """(parts, in, out/parts) view of ``weight``'s row blocks: same storage."""
    return weight.view(parts, weight.shape[0] // parts, weight.shape[1]).transpose(1, 2)


def _block_product(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    parts, width, part = blocks.shape
    y = torch.bmm(x.reshape(1, rows, width).expand(parts, rows, width), blocks)  # (parts, rows, out/parts)
    y = y.transpose(0, 1).reshape(*x.shape[:-1], parts * part)
    return y if bias is None else y + bias


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``parts`` row blocks of ``weight`` when ``x`` has at most
    MAX_ROWS rows (and the blocks divide evenly), else ``F.linear``. No thread-count, autograd
    or device checks: the caller made them (``linear``) or fixed ``parts`` (a traced step)."""
    out, width = weight.shape
    rows = x.numel() // width if width else 0
    if parts < 2 or rows == 0 or rows > MAX_ROWS or out % parts or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    return _block_product(x, _blocks(weight, parts), bias, rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for at most MAX_ROWS rows on CPU without autograd, computed
    as a batched matmul over row blocks of ``weight`` so that every thread streams a block."""
    if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)) or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return rows_linear(x, weight, bias, torch.get_num_threads())


def block_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, memo: dict) -> torch.Tensor:
    """``linear`` with the weight's row-block view kept in ``memo`` (a module's ``__dict__``) for
    the weight's storage and the thread count: a decode step makes ~150 of these products, and
    the fewer small ops around each the better. (Inside a traced step: ``rows_linear`` with the
    step's fixed block count; the memo's storage checks cannot be traced.)"""
    traced = traced_parts()
    if traced:
        return rows_linear(x, weight, bias, traced)
    rows = x.numel() // weight.shape[1]
    if rows > MAX_ROWS or rows == 0 or torch.is_grad_enabled() or x.device.type != "cpu":
        return linear(x, weight, bias)
    parts, ptr = torch.get_num_threads(), weight.data_ptr()
    kept = memo.get("_blocks")
    if kept is None or kept[0] != ptr or kept[1] != parts:
        if parts < 2 or weight.shape[0] % parts or not weight.is_contiguous():
            return F.linear(x, weight, bias)
        kept = memo["_blocks"] = (ptr, parts, _blocks(weight, parts))
    return _block_product(x, kept[2], bias, rows)


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose few-row products on CPU use every core (see ``linear``); same
    parameters, state dict and results (to float rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.weight, self.bias, self.__dict__)

    def _apply(self, fn, recurse=True):  # .to() / .half(): the kept block view would pin the old storage
        self.__dict__.pop("_blocks", None)
        return super()._apply(fn, recurse)


_PLAIN_LINEAR = (nn.Linear, DecodeLinear)


def is_plain_linear(module) -> bool:
    """An ``nn.Linear`` or ``DecodeLinear`` itself (not a subclass someone wrapped it in)."""
    return module.__class__ in _PLAIN_LINEAR


class FusedLinears:
    """Linear layers of ``owner`` that read the same input, their weights and biases made row
    blocks of one (Σout, in) buffer, so that a step reads them with ONE matmul. The layers keep
    their own parameters (names, state dict, LoRA targets): the fused path is used only while
    every layer is still ``owner``'s and every parameter still lives where it was put (a
    replaced or wrapped layer, a re-assigned ``.data``, a hook or another subclass turns it off)."""

    def __init__(self, owner: nn.Module, names: list[str], linears: list[nn.Linear]):
        self.owner, self.names, self.linears = owner, names, linears
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears], dim=0)  # (Σout, in)
            self.bias = None
            if any(lin.bias is not None for lin in linears):
                parts = [lin.bias if lin.bias is not None else self.weight.new_zeros(n) for lin, n in zip(linears, self.sizes)]
                self.bias = torch.cat(parts)
            start = 0
            for lin, n in zip(linears, self.sizes):
                lin.weight.data = self.weight[start : start + n]
                if lin.bias is not None:
                    lin.bias.data = self.bias[start : start + n]
                start += n
        self.pointers = [(lin.weight.data_ptr(), None if lin.bias is None else lin.bias.data_ptr()) for lin in linears]

    def valid(self) -> bool:
        if traced_parts():  # a compiled step checked it just before the call
            return True
        modules = self.owner._modules
        for name, lin, (w, b) in zip(self.names, self.linears, self.pointers):
            if modules.get(name) is not lin or not is_plain_linear(lin) or lin._forward_hooks or lin._forward_pre_hooks:
                return False
            params = lin._parameters  # (not lin.weight: nn.Module.__getattr__ is slow on a hot path)
            if params["weight"].data_ptr() != w or (b is not None and params["bias"].data_ptr() != b):
                return False
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side: (..., Σout)."""
        return block_linear(x, self.weight, self.bias, self.__dict__)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.matmul(x).split(self.sizes, dim=-1)

    def release(self) -> None:
        """Each parameter gets its own storage back."""
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
        with torch.no_grad():
            self.buffer = torch.cat([p.data for p in params], dim=0)
            start = 0
            for p in params:
                p.data = self.buffer[start : start + p.shape[0]]
                start += p.shape[0]
        self.pointers = [p.data_ptr() for p in params]

    def valid(self) -> bool:
        if traced_parts():
            return True
        return all(p.data_ptr() == ptr for p, ptr in zip(self.params, self.pointers))

    def release(self) -> None:
        for p in self.params:
            p.data = p.data.clone()


def linear_module(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; for a hook-free ``DecodeLinear`` its forward without the module call."""
    if module.__class__ is DecodeLinear and not (module._forward_hooks or module._forward_pre_hooks):
        params = module._parameters
        return block_linear(x, params["weight"], params["bias"], module.__dict__)
    return module(x)

# ``module.__dict__`` keys under which modules keep fusions (objects with ``valid`` and ``release``)
FUSION_KEYS = ("_fused_inputs", "_fused_maps")


# -------------------------------------------------------------------- decode-mode module classes
def drop_fusions(module: nn.Module) -> None:
    """Forget ``module``'s fusions (their buffers would pin the old storage after a ``.to()``)."""
    for key in FUSION_KEYS:
        module.__dict__.pop(key, None)


class _GatedMLPDecode:
    """Mixed into a gated MLP's class (``down(act(gate(x)) * up(x))``: Llama, Mistral, Qwen2,
    Gemma …): without autograd, gate and up are one matmul over their fused weights."""

    def _apply(self, fn, recurse=True):
        drop_fusions(self)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.__dict__.get("_fused_inputs")
        if fused is None or torch.is_grad_enabled() or not fused.valid():
            return super().forward(x)
        gate, up = fused(x)
        return linear_module(self.down_proj, self.act_fn(gate).mul_(up))


class _RMSNormDecode:
    """Mixed into an RMSNorm class that computes ``weight * x / rms(x)``: without autograd, in
    float32, four ops (two in place) instead of HF's eight; on this CPU also faster than
    ``F.rms_norm`` (17 vs 24 us for one 576-wide row, measured in a loop)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.dtype != torch.float32 or w.dtype != torch.float32:
            return super().forward(x)
        return torch.mul(x, torch.mean(x * x, -1, keepdim=True).add_(self.__dict__["_rms_eps"]).rsqrt_()).mul_(w)


_DECODE_CLASSES: dict = {}


def _decode_class(mixin: type, cls: type) -> type:
    key = (mixin, cls)
    if key not in _DECODE_CLASSES:
        _DECODE_CLASSES[key] = type(f"Decode{cls.__name__}", (mixin, cls), {"_decode_base": cls})
    return _DECODE_CLASSES[key]


@torch.no_grad()
def _same_outputs(module: nn.Module, new_class: type, width: int, dtype: torch.dtype) -> bool:
    """Does ``module`` compute the same with ``new_class`` as now, on a probe input? (The classes
    above assume a formula; a family that computes something else, e.g. Gemma's (1 + w)
    RMSNorm, keeps its own class.)"""
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    old = type(module)
    try:
        ref = module(x)
        module.__class__ = new_class
        out = module(x)
    except Exception:  # noqa: BLE001 - any failure means "not this formula"
        return False
    finally:
        module.__class__ = old
    if not isinstance(ref, torch.Tensor) or not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return False
    return bool((out - ref).abs().max() <= 1e-5 * (1 + ref.abs().max()))


def _fuse_gate_up(module: nn.Module) -> None:
    module.__dict__["_fused_inputs"] = FusedLinears(module, ["gate_proj", "up_proj"], [module.gate_proj, module.up_proj])


def _fuse_gated_mlp(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not (is_plain_linear(gate) and is_plain_linear(up) and is_plain_linear(getattr(module, "down_proj", None))):
        return False
    if not callable(getattr(module, "act_fn", None)) or gate.in_features != up.in_features or module.__dict__.get("_fused_inputs") is not None:
        return False
    new_class = _decode_class(_GatedMLPDecode, type(module))
    _fuse_gate_up(module)
    if _same_outputs(module, new_class, gate.in_features, gate.weight.dtype):
        module.__class__ = new_class
        return True
    module.__dict__.pop("_fused_inputs").release()
    return False


def _fast_rms_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(w, nn.Parameter) or w.dim() != 1:
        return False
    if not isinstance(eps, float) or any(True for _ in module.children()) or w.dtype != torch.float32:
        return False
    module.__dict__["_rms_eps"] = eps
    new_class = _decode_class(_RMSNormDecode, type(module))
    if _same_outputs(module, new_class, w.shape[0], w.dtype):
        module.__class__ = new_class
        return True
    del module.__dict__["_rms_eps"]
    return False


def _on_cpu(model: nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())


def _fuse(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        fuse = getattr(module, "fuse_input_linears", None)
        if callable(fuse):  # student mixers: the linears reading one input become one matmul
            if module.__dict__.get("_fused_inputs") is None and fuse():
                count += 1
        elif isinstance(module, _GatedMLPDecode):  # back from standard_layout: fuse again
            if module.__dict__.get("_fused_inputs") is None:
                _fuse_gate_up(module)
                count += 1
        elif _fuse_gated_mlp(module):
            count += 1
    return count


def _unfuse(model: nn.Module) -> int:
    count = 0
    with torch.no_grad():
        for module in model.modules():
            module.__dict__.pop("_blocks", None)  # a kept view of a fused buffer would pin it
            found = [module.__dict__.pop(key) for key in FUSION_KEYS if module.__dict__.get(key) is not None]
            for fusion in found:
                fusion.release()
            count += bool(found)
    return count


@torch.no_grad()
def cpu_decode_layout(model: nn.Module, compile: bool = False) -> int:
    """Put ``model`` in CPU decode mode (see the module docstring). Returns how many modules
    changed; a no-op (0) off CPU or when already done. ``compile``: a student's decode plan
    also runs its layers as one ``torch.compile``d function (student/compiled_step.py; the
    first step compiles: about a minute on a 2-core CPU, seconds once cached on disk)."""
    if not _on_cpu(model):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
            count += 1
        elif "_decode_base" not in type(module).__dict__ and _fast_rms_norm(module):
            count += 1
    count += _fuse(model)
    enable = getattr(model, "enable_decode_plan", None)  # a student: one-token steps without HF's plumbing
    if callable(enable) and (enable(compile=True) if compile else enable()):
        count += 1
    return count


def undo_cpu_decode_layout(model: nn.Module) -> int:
    """Back to plain ``nn.Linear`` modules with independent weights. Returns how many modules changed."""
    count = _unfuse(model)
    disable = getattr(model, "disable_decode_plan", None)
    if callable(disable) and disable():
        count += 1
    for module in model.modules():
        if type(module) is DecodeLinear:
            module.__class__ = nn.Linear
            count += 1
        elif "_decode_base" in type(module).__dict__:
            module.__class__ = type(module)._decode_base
            module.__dict__.pop("_rms_eps", None)
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
