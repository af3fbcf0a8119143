"""Weights at fewer bytes for decoding: bfloat16, and int8 weight-only linear layers.

A one-token step reads every weight once, so on a CPU its floor is (weight bytes) / (memory
stream rate): bfloat16 halves float32's bytes, int8 weights quarter them.

``apply_weight_format(model, dtype, quantize)`` (in place, teacher or student; call it before
``cpu_decode_layout``, which fuses whatever linear layers are still plain):
- ``dtype="bfloat16"``: every parameter in bfloat16 — activations, the residual stream and the KV
  cache follow — except the SSM parameters Mamba keeps in float32 (``A_log``, ``D``, ``dt_bias``,
  a raw decay ``A``; ``FP32_PARAMETERS``); buffers keep their dtype (RoPE's inv_freq rounded to
  bfloat16 would turn position 1000's angles by up to ~4 rad). The mixers compute Δ, the decays and the
  recurrent state in float32 whatever the input dtype (mamba_ssm's kernels do the same);
- ``quantize="int8"``: every ``nn.Linear`` (lm_head included: the largest single read of a small
  model) becomes an ``Int8Linear``: its weight int8 with one scale per output channel
  (``ops/quant.py``), the product computed by ``aten._weight_int8pack_mm`` with activations in
  ``dtype``. Embeddings stay in ``dtype``: a step reads one row of them. A tied lm_head gets its
  own int8 copy (the embedding keeps the float table).
Inference only (decode, eval): an int8 layer has no gradient for its weight, and its state dict
holds ``qweight`` / ``scales`` buffers, not an ``nn.Linear``'s ``weight``: not a checkpoint format.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.ops.quant import int8_linear, quantize_per_channel_int8
from attn2ssm.precision import warn_if_slow_bf16

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZE = ("int8",)
# Parameters (by attribute name) that stay float32 in a bfloat16 model, as in Mamba: the SSM's
# decay (A_log; hedgemamba's raw A), skip (D) and Δ bias.
FP32_PARAMETERS = frozenset({"A_log", "A", "D", "dt_bias"})


def check_weight_format(dtype: str | None, quantize: str | None) -> tuple[torch.dtype, str | None]:
    """``--dtype`` / ``--quantize`` checked: (torch dtype, "int8" or None); a one-line error otherwise."""
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise ConfigError(
            f"--dtype {dtype!r} is not a decode dtype here",
            f"choose from {', '.join(DTYPES)}, e.g. --dtype bfloat16",
        )
    if quantize in (None, "", "none"):
        return DTYPES[dtype], None
    if quantize not in QUANTIZE:
        raise ConfigError(
            f"--quantize {quantize!r} is not a weight format here",
            "use --quantize int8 (int8 weight-only, per-channel scales) or leave it out",
        )
    return DTYPES[dtype], quantize


def format_name(dtype: str | None, quantize: str | None) -> str:
    """How a weight format is named in benchmark rows: float32, bfloat16, int8 (float32
    activations), bfloat16+int8."""
    dtype = dtype or "float32"
    if not quantize or quantize == "none":
        return dtype
    return quantize if dtype == "float32" else f"{dtype}+{quantize}"


class Int8Linear(nn.Module):
    """A linear layer with an int8 weight (out, in) and per-output-channel scales: computes
    ``x @ (q * scale[:, None]).T + bias`` (``ops.quant.int8_linear``). Built from an ``nn.Linear``
    by ``from_linear``; inference only."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "Int8Linear":
        q, scales = quantize_per_channel_int8(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()
        # the kernel takes bfloat16 activations and scales (ops/quant.py)
        return cls(q, scales.to(torch.bfloat16), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 per-channel"


def _is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a decode-mode class standing for one (``DecodeLinear``)."""
    return isinstance(module, nn.Linear) and getattr(type(module), "_decode_base", nn.Linear) is nn.Linear


@torch.no_grad()
def apply_weight_format(model: nn.Module, dtype: str | None = "float32", quantize: str | None = None) -> dict:
    """Put ``model``'s weights in ``dtype`` (float32 / bfloat16) and, with ``quantize="int8"``, its
    linear layers in int8 (see the module docstring). Returns what changed: the format's name,
    how many linear layers were quantised and the bytes a one-token step reads (``weight_bytes``)."""
    torch_dtype, quantize = check_weight_format(dtype, quantize)
    # on a CPU without native bf16, prefill slows; one-token steps (memory-bound) do not
    if torch_dtype == torch.bfloat16:
        with torch.enable_grad():  # (a first probe, not yet cached on disk, times a backward)
            warn_if_slow_bf16(
                next(model.parameters()).device,
                "--dtype bfloat16",
                "prompts (prefill) and perplexity windows run that much slower; one-token decode steps read half the bytes and are not slowed",
            )
    if torch_dtype != torch.float32:
        for module in model.modules():  # parameters only: buffers (RoPE's inv_freq) keep their float32
            for name, param in module.named_parameters(recurse=False):
                if name not in FP32_PARAMETERS and param.is_floating_point():
                    param.data = param.data.to(torch_dtype)
        if hasattr(model, "config"):
            model.config.dtype = torch_dtype  # what HF reads to allocate caches and masks
    quantized = 0
    if quantize == "int8":
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if _is_linear(child):
                    setattr(parent, name, Int8Linear.from_linear(child, torch_dtype))
                    quantized += 1
    return {
        "format": format_name(dtype, quantize),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "quantize": quantize,
        "int8_linears": quantized,
        "weight_bytes": step_weight_bytes(model),
    }


def step_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer except the embedding
    tables, of which a step reads one row each (their rows are counted). Tensors shared by several
    modules (a tied lm_head) count once per read: the lm_head reads the whole table."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total, seen = 0, set()
    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t is None or not t.is_floating_point() and t.dtype != torch.int8:
                continue
            if isinstance(module, nn.Embedding) and id(t) == id(module.weight):
                total += t.shape[1] * t.element_size()  # one row
                continue
            if id(t) in seen and id(t) not in embeddings:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
