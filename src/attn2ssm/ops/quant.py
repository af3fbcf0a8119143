"""int8 weight-only linear products: a weight stored as int8 with one float scale per output channel.

Decoding one token reads every weight once, so a step's floor is (weight bytes) / (memory stream
rate): int8 weights are a quarter of float32's bytes. Weight-only means the activations stay in
floating point and the weight is dequantised inside the kernel (``torch.ops.aten._weight_int8pack_mm``
on CPU: int8 weight (out, in), scales (out,) in the activation's dtype); it is not
``torch.ao.quantization.quantize_dynamic``, which also rounds the activations to int8 per call.

Symmetric per-output-channel quantisation (as LLM.int8()'s vector-wise weight scales and
llama.cpp's q8_0 per block): ``scale[o] = max_i |W[o, i]| / 127``, ``q = round(W / scale)`` in
[-127, 127]. The round-trip error of an element is at most scale / 2.

Pure functions of tensors; which modules use them is ``attn2ssm.decode.quantize``'s business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight → (int8 (out, in), float32 scales (out,)) with ``W ≈ q * scale[:, None]``.
    An all-zero row gets scale 1 (its q is 0 either way), never a division by zero."""
    if weight.dim() != 2:
        raise ValueError(
            f"quantize_per_channel_int8 takes a (out, in) weight, got shape {tuple(weight.shape)}"
        )
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales


def dequantize_per_channel_int8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight an int8 one stands for: ``q * scales[:, None]`` in ``dtype``."""
    return (q.float() * scales.float()[:, None]).to(dtype)


def int8_linear_reference(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``int8_linear`` computed plainly: the dequantised weight in float32, the result in x's dtype."""
    bias = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize_per_channel_int8(q, scales), bias).to(x.dtype)


_PACK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, q * scales[:, None], bias)`` without materialising the float weight.

    x: (..., in) float; q: (out, in) int8; scales: (out,) float (bfloat16 for the kernel: keep them
    so to spare a cast per call); bias: (out,) or None. CPU: ``aten._weight_int8pack_mm`` with
    bfloat16 activations (AVX-512 kernel, accumulates in float32), the result in x's dtype;
    elsewhere the dequantised reference. Inference only: no gradient flows to ``q``."""
    if x.device.type != "cpu" or x.dtype not in _PACK_DTYPES or q.dtype != torch.int8:
        return int8_linear_reference(x, q, scales, bias)
    out, width = q.shape
    # The kernel is fast only with bfloat16 activations on this CPU (one thread, a 1536x576 weight
    # in cache, CPU time per one-row product: 26 us bf16, 555 us float32 = its slow path; float32
    # F.linear 51 us): float32 inputs are rounded to bfloat16 for the product (relative 2^-9, below
    # the weight's own int8 rounding) and the result handed back in float32.
    a = x.reshape(-1, width).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int8pack_mm(
        a, q, scales if scales.dtype == torch.bfloat16 else scales.to(torch.bfloat16)
    )
    y = y.view(*x.shape[:-1], out).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)
