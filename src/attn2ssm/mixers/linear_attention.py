"""Causal linear attention as a drop-in for a teacher attention module.

Starts from the teacher's q/k/v/o (GQA kv heads repeated), applies RoPE where the teacher does
(before the feature map by default, so student and teacher see the same q and k), then
φ(q), φ(k) and normalised linear attention. Training and prefill use the chunked form, one-token
decode the step form; both carry the same ``LinearAttentionState`` in the student cache.
"""

from __future__ import annotations

import torch

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.feature_maps import build_feature_map
from attn2ssm.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_quadratic,
    linear_attention_step,
)


class LinearAttentionMixer(AttentionLikeMixer):
    mixer_type = "linear_attention"

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        feature_map: str = "elu",
        feature_map_options: dict | None = None,
        chunk_size: int = 64,
        eps: float = 1e-6,
        rope: str = "before_map",
    ):
        super().__init__(geometry, layer_idx)
        opts = feature_map_options or {}
        self.feature_map_q = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.feature_map_k = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.chunk_size, self.eps = chunk_size, eps
        if rope not in ("before_map", "none"):
            raise ConfigError(f"linear_attention option rope={rope!r} is not valid", "use rope: before_map (default) or none")
        self.use_rope = rope == "before_map"

    def features(self, hidden_states, position_embeddings=None, offset: int = 0):
        """(φq, φk, v), each (b, h, l, ·) — exposed for distillation losses. ``offset`` is the
        absolute position of the first token (tokens already in the state), for position-aware maps."""
        q, k, v = self.project_qkv(hidden_states, position_embeddings if self.use_rope else None)
        positions = torch.arange(offset, offset + hidden_states.shape[1], device=hidden_states.device)
        return self.feature_map_q(q, positions), self.feature_map_k(k, positions), v

    def attention_weights(self, hidden_states, position_embeddings=None, mask=None):
        """The materialised (b, h, l, l) mixing matrix for this input (quadratic form)."""
        return self.forward_quadratic(hidden_states, position_embeddings, mask)[1]

    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), weights (b, h, l, l)) through the materialised form — for
        attention transfer, which needs both and runs on short blocks."""
        fq, fk, v = self.features(hidden_states, position_embeddings)
        y, weights = linear_attention_quadratic(fq, fk, v, mask, eps=self.eps)
        return self.merge_heads(y), weights

    def forward(self, hidden_states, *args, position_embeddings=None, **kwargs):
        b, l, _ = hidden_states.shape
        layer = self.cache_layer(kwargs)
        fq, fk, v = self.features(hidden_states, position_embeddings, offset=0 if layer is None else layer.seen)
        mask = self.padding_mask(l)
        state = None if layer is None else layer.states.get("linear")
        if state is not None and l == 1:  # decode: O(f·d) step against the carried state
            if mask is not None:
                m = mask[:, None, :, None].to(fk.dtype)
                fq, fk, v = fq * m, fk * m, v * m
            y, state = linear_attention_step(fq[:, :, 0], fk[:, :, 0], v[:, :, 0], state, eps=self.eps)
            y = y[:, :, None]
        else:
            y, state = linear_attention_chunked(fq, fk, v, mask, state, chunk_size=self.chunk_size, eps=self.eps)
        if layer is not None:
            layer.states["linear"] = state
            layer.advance(l)
        return self.merge_heads(y), None

