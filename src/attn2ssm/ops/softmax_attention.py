"""Exact causal softmax attention of a few query heads over a growing key/value cache.

What a head-level hybrid's kept heads compute (mixers/kept_heads.py): the queries of the ``l`` new
tokens attend to every key before them — the ``T − l`` cached ones and the new ones up to
themselves. ``q`` is (b, h, l, d); ``k, v`` are (b, g, T, d) with T ≥ l, the last l rows the new
tokens', each of the g kv heads shared by h / g consecutive query heads (GQA, transformers'
``repeat_kv`` order); ``key_mask`` is an optional (b, T) 0/1 padding mask of the keys.

A masked key gets weight exactly 0. A query row whose every visible key is masked (a left-padded
query) still sees its own key, so no row is empty and no NaN appears; real rows never see a pad.
Two forms that tests hold equal (fp32, 1e-5): ``softmax_attention`` (PyTorch's fused SDPA: prefill
and decode) and ``softmax_attention_weights`` (the materialised (b, h, l, T) weights: the reference,
and what attention transfer compares).
"""

from __future__ import annotations

import torch


def allowed_keys(l: int, total: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
    """(b or 1, 1, l, T) bool: query i (absolute position T − l + i) sees key j ≤ its position that
    is real, and always itself."""
    offset = total - l
    i = torch.arange(l, device=device)[:, None] + offset
    j = torch.arange(total, device=device)[None, :]
    causal = j <= i
    if key_mask is None:
        return causal[None, None]
    real = key_mask.bool()[:, None, None, :]  # (b, 1, 1, T)
    return (causal & real) | (j == i)


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    groups = heads // t.shape[1]
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def softmax_attention(q, k, v, *, scaling: float, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, l, d): softmax(q kᵀ · scaling + mask) v over the allowed keys (module docstring)."""
    allowed = allowed_keys(q.shape[2], k.shape[2], key_mask, q.device)
    k, v = _repeat(k, q.shape[1]), _repeat(v, q.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=scaling
    )


def softmax_attention_weights(q, k, *, scaling: float, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The materialised weights (b, h, l, T), float32; masked keys exactly 0."""
    allowed = allowed_keys(q.shape[2], k.shape[2], key_mask, q.device)
    k = _repeat(k, q.shape[1])
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        return torch.softmax(scores, dim=-1)
