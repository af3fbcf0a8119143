"""Which keys each query may see: causal, optional sliding window, optional key padding.

Mirrors transformers' masking_utils: causal is ``kv <= q`` by sequence index, the sliding
window keeps ``q - kv < window`` (the query itself plus window-1 earlier tokens), and a
padding mask removes padded keys. Positions are sequence indices, not position_ids, exactly
as the teachers' own mask builders do for a cache-free forward.
"""

from __future__ import annotations

import torch


def allowed_keys(
    length: int,
    sliding_window: int | None = None,
    padding_mask: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean mask, True where query i may attend key j.

    Returns (1, 1, l, l) without padding, (b, 1, l, l) with a (b, l) 0/1 ``padding_mask``.
    """
    q_idx = torch.arange(length, device=device)[:, None]  # (l, 1)
    kv_idx = torch.arange(length, device=device)[None, :]  # (1, l)
    allowed = kv_idx <= q_idx  # (l, l)
    if sliding_window is not None:
        allowed = allowed & (q_idx - kv_idx < sliding_window)
    allowed = allowed[None, None]  # (1, 1, l, l)
    if padding_mask is not None:
        if padding_mask.dim() != 2 or padding_mask.shape[-1] != length:
            raise ValueError(
                f"attention_mask must be a (batch, {length}) 0/1 padding mask, got shape {tuple(padding_mask.shape)}"
            )
        keys = padding_mask.to(device=allowed.device).bool()[:, None, None, :]  # (b, 1, 1, l)
        allowed = allowed & keys
    return allowed
