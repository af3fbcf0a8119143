"""Run a student three ways for the cache tests: one full forward, and the same tokens fed in pieces
through ``model.new_cache()`` (chunked prefill, or a prefill then one token at a time)."""

import torch


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def full_and_pieces(model, ids, mask, pieces):
    """(logits of one full forward, logits of the pieces run through a cache, concatenated)."""
    pos = positions(mask)
    full = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    cache, outs, start = model.new_cache(), [], 0
    for size in pieces:
        end = start + size
        out = model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=pos[:, start:end], past_key_values=cache, use_cache=True)
        outs.append(out.logits)
        start = end
    return full, torch.cat(outs, 1)
