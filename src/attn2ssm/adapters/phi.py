"""Phi (Phi-1, Phi-1.5, Phi-2): partial RoPE, biased projections, output named ``dense``.

Only the first ``int(head_dim * partial_rotary_factor)`` dims of each head are rotated; the
model's rotary_emb already returns cos/sin of that width. ``qk_layernorm=True`` adds a
LayerNorm over head_dim on q and k before RoPE, reported as q_norm/k_norm.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter, partial_rotary_factor
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class PhiAdapter(Adapter):
    family = "phi"
    model_types = ("phi",)
    o_attr = "dense"

    def rotary_dim(self, config, head_dim: int) -> int:
        return int(head_dim * partial_rotary_factor(config))

    def biases(self, config) -> tuple[bool, bool]:
        return True, True

    def has_qk_norm(self, config) -> bool:
        return bool(getattr(config, "qk_layernorm", False))

    def qk_norms(self, attn):
        if getattr(attn, "qk_layernorm", False):
            return attn.q_layernorm, attn.k_layernorm
        return None, None
