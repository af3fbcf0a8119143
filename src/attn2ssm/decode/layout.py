"""CPU decode mode: one-token matmuls that use every core, fused projections, fewer ops per step.

``cpu_decode_layout(model)`` (in place, any ``nn.Module``: teacher or student):
- every ``nn.Linear`` becomes a ``DecodeLinear`` (a subclass with the same parameters and state
  dict) whose forward computes few-row products on CPU without autograd as a batched matmul over
  row blocks of the weight (``ops/rows.py``: one-row products otherwise run on one core), its
  row-block view kept between calls, and is ``F.linear`` otherwise (training, GPU, long prompts);
- a student mixer gets its decode-mode class (mixers.py): its input projections (q/k/v and the
  SSM's gate/Δ projections) become row blocks of one buffer read with one matmul at inference, and
  a linear-attention mixer steps in a hand-fused form (its query and key Hedgehog maps stacked
  the same way, q and k roped together, the state updated in place);
- any model's gated MLPs (``down(act(gate(x)) * up(x))``) read gate and up with one matmul, and
  its RMSNorms run in four ops (float32, autograd off) — each only after a probe input
  showed the fused form computes what the module computes (Gemma's (1 + w) norm keeps its class);
- a student gets its decode-mode class (model.py: ``save_pretrained`` writes independent tensors)
  and, where its layers allow it, a one-token ``DecodePlan`` (plan.py) that its decode-mode
  ``forward`` hands one-token calls to; with ``compile=True`` the plan's layers also run as one
  ``torch.compile``d function (compiled.py).
A decode step is bound by weight streaming AND by per-op overhead (~3-8 us a small op on the
2-core machine, ~40 small ops per layer): fewer ops per layer is as much of the gain as the
matmul route.
``undo_cpu_decode_layout(model)`` reverses all of it: every module gets its own class back and
its parameters their own storage. A ``.to()`` drops the fused buffers (they would pin the old
storage); call ``cpu_decode_layout`` again after it.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.decode import mixers as decode_mixers
from attn2ssm.decode.fusion import (
    FusedLinears,
    call_linear,
    decode_class,
    drop_fusions,
    fusion_holds,
    is_plain_linear,
    release_fusions,
    row_parts,
)
from attn2ssm.decode.model import attach_student
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.ops.rows import MEMO_KEY, block_linear, rows_linear
from attn2ssm.student.modeling import Attn2SSMForCausalLM, Attn2SSMPreTrainedModel

__all__ = ["DecodeLinear", "cpu_decode_layout", "undo_cpu_decode_layout"]


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose few-row products on CPU use every core (``ops.rows.block_linear``);
    same parameters, state dict and results (to float rounding). Inside a ``torch.compile`` trace
    (its kept view's storage checks cannot be traced) it is the row-block product with the block
    count a compiled decode step keeps on it (compiled.py), else ``F.linear``."""

    _decode_base = nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return rows_linear(x, self.weight, self.bias, row_parts(self))
        return block_linear(x, self.weight, self.bias, self.__dict__)

    def _apply(self, fn, recurse=True):  # .to() / .half(): the kept block view would pin the old storage
        self.__dict__.pop(MEMO_KEY, None)
        return super()._apply(fn, recurse)


# -------------------------------------------------------------------- decode-mode module classes
class _GatedMLPDecode:
    """Mixed into a gated MLP's class (``down(act(gate(x)) * up(x))``: Llama, Mistral, Qwen2,
    Gemma …): without autograd, gate and up are one matmul over their fused weights."""

    def _apply(self, fn, recurse=True):
        drop_fusions(self)
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.__dict__.get("_fused_inputs")
        if torch.is_grad_enabled() or not fusion_holds(fused):
            return super().forward(x)
        gate, up = fused(x)
        return call_linear(self.down_proj, self.act_fn(gate).mul_(up))


class _RMSNormDecode:
    """Mixed into an RMSNorm class that computes ``weight * x / rms(x)``: without autograd, in
    float32, four ops (two in place) instead of HF's eight; on this CPU also faster than
    ``F.rms_norm`` (17 vs 24 us for one 576-wide row, measured in a loop)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() or x.dtype != torch.float32 or w.dtype != torch.float32:
            return super().forward(x)
        return torch.mul(
            x, torch.mean(x * x, -1, keepdim=True).add_(self.__dict__["_rms_eps"]).rsqrt_()
        ).mul_(w)


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
    module.__dict__["_fused_inputs"] = FusedLinears(
        module, ["gate_proj", "up_proj"], [module.gate_proj, module.up_proj]
    )


def _fuse_gated_mlp(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not (
        is_plain_linear(gate) and is_plain_linear(up) and is_plain_linear(getattr(module, "down_proj", None))
    ):
        return False
    if (
        not callable(getattr(module, "act_fn", None))
        or gate.in_features != up.in_features
        or module.__dict__.get("_fused_inputs") is not None
    ):
        return False
    new_class = decode_class(_GatedMLPDecode, type(module))
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
    new_class = decode_class(_RMSNormDecode, type(module))
    if _same_outputs(module, new_class, w.shape[0], w.dtype):
        module.__class__ = new_class
        return True
    del module.__dict__["_rms_eps"]
    return False


def _on_cpu(model: nn.Module) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())


def _fuse(model: nn.Module) -> int:
    count, signed = 0, decode_mixers.SignedSin()  # one signed sin per token for all the model's mixers
    for module in model.modules():
        if isinstance(module, AttentionLikeMixer):  # student mixers: their decode-mode class and fusions
            count += decode_mixers.attach(module, signed)
        elif isinstance(module, _GatedMLPDecode):  # fusions dropped by a .to(): fuse again
            if module.__dict__.get("_fused_inputs") is None:
                _fuse_gate_up(module)
                count += 1
        elif _fuse_gated_mlp(module):
            count += 1
    return count


@torch.no_grad()
def cpu_decode_layout(model: nn.Module, compile: bool = False) -> int:
    """Put ``model`` in CPU decode mode (see the module docstring). Returns how many modules
    changed; a no-op (0) off CPU or when already done. ``compile``: a student's decode plan
    also runs its layers as one ``torch.compile``d function (decode/compiled.py; the first step
    compiles: about a minute on a 2-core CPU, seconds once cached on disk)."""
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
    if isinstance(model, Attn2SSMForCausalLM):  # a student: one-token steps without HF's plumbing
        from attn2ssm.decode.plan import enable_decode_plan

        count += enable_decode_plan(model, compile=compile)
    elif isinstance(model, Attn2SSMPreTrainedModel):
        count += attach_student(model, causal_lm=False)
    return count


def undo_cpu_decode_layout(model: nn.Module) -> int:
    """Back to every module's own class (plain ``nn.Linear`` modules …) with independent weights.
    Returns how many modules changed."""
    from attn2ssm.decode.plan import disable_decode_plan

    count = len({id(module) for module, _, _ in release_fusions(model)})
    count += disable_decode_plan(model)
    for module in model.modules():
        module.__dict__.pop("_row_parts", None)
        if type(module) is DecodeLinear:
            module.__class__ = nn.Linear
            count += 1
        elif "_decode_base" in type(module).__dict__:
            module.__class__ = type(module)._decode_base
            module.__dict__.pop("_rms_eps", None)
            decode_mixers.detach(module)
            count += 1
    return count
