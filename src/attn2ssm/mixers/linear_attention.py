"""Causal linear attention as a drop-in for a teacher attention module.

Starts from the teacher's q/k/v/o (GQA kv heads repeated), applies RoPE where the teacher does
(before the feature map by default, so student and teacher see the same q and k), then
φ(q), φ(k) and normalised linear attention. Training and prefill use the chunked form, one-token
decode the step form; both carry the same ``LinearAttentionState`` in the student cache.
"""

from __future__ import annotations

import math

import torch

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.feature_maps import HedgehogMap, build_feature_map, hedgehog_softmax_step
from attn2ssm.decode.fusion import ParamStack, call_linear
from attn2ssm.ops.linear_attention import (
    linear_attention_chunked,
    linear_attention_quadratic,
    linear_attention_step,
    window_linear_attention,
)
from attn2ssm.ops.rope import apply_rotary


class StackedMaps:
    """A mixer's query and key Hedgehog maps with their weights and biases stacked (one buffer
    each, ``ParamStack``): a decode step computes both maps' features in one matmul. Used only
    while both maps are still the mixer's, hook-free, and their parameters where they were put."""

    def __init__(self, owner, maps):
        self.owner, self.maps = owner, maps
        self.weight, self.bias = ParamStack([m.weight for m in maps]), ParamStack([m.bias for m in maps])

    def valid(self, trusted: bool = False) -> bool:
        if trusted:  # a compiled step checked it just before the call
            return True
        modules = self.owner._modules
        if modules.get("feature_map_q") is not self.maps[0] or modules.get("feature_map_k") is not self.maps[1]:
            return False
        if any(m._forward_hooks or m._forward_pre_hooks for m in self.maps):
            return False
        return self.weight.valid() and self.bias.valid()

    def release(self) -> None:
        self.weight.release()
        self.bias.release()

    def rebuild(self) -> None:
        self.weight.rebuild()
        self.bias.rebuild()


class LinearAttentionMixer(AttentionLikeMixer):
    mixer_type = "linear_attention"
    # forward_quadratic's matrix is normalised attention (rows sum to 1): attention transfer can
    # match it to the teacher's softmax weights
    normalized_weights = True

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        feature_map: str = "elu",
        feature_map_options: dict | None = None,
        chunk_size: int = 64,
        eps: float = 1e-6,
        rope: str = "before_map",
        window: int = 0,
        window_gamma: float = 0.5,
    ):
        super().__init__(geometry, layer_idx)
        opts = feature_map_options or {}
        self.feature_map_q = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.feature_map_k = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.chunk_size, self.eps = chunk_size, eps
        if rope not in ("before_map", "none"):
            raise ConfigError(f"linear_attention option rope={rope!r} is not valid", "use rope: before_map (default) or none")
        self.use_rope = rope == "before_map"
        # LoLCATs-style: the last `window` keys get exact softmax weights γ_h·exp(q·k·scale − max),
        # older keys linear weights; γ_h = sigmoid(window_factor_h) is learned per head.
        if window < 0 or not 0.0 < window_gamma < 1.0:
            raise ConfigError(f"window={window}, window_gamma={window_gamma} are out of range", "use window >= 0 and 0 < window_gamma < 1")
        self.window, self.scaling = window, geometry.get("scaling", self.head_dim**-0.5)
        if window:
            # γ = sigmoid(factor) starts at window_gamma. Plain floats: __init__ runs on the meta
            # device when transformers loads a model, where a tensor has no value to read back.
            self.window_factor = torch.nn.Parameter(torch.full((self.num_heads,), math.log(window_gamma / (1.0 - window_gamma))))

    def _qkv_features(self, hidden_states, position_embeddings=None, offset: int = 0):
        inputs = self.project_inputs(hidden_states)
        q, k, v = self.project_qkv(hidden_states, position_embeddings if self.use_rope else None, inputs)
        positions = torch.arange(offset, offset + hidden_states.shape[1], device=hidden_states.device)
        return q, k, v, self.feature_map_q(q, positions), self.feature_map_k(k, positions)

    def features(self, hidden_states, position_embeddings=None, offset: int = 0):
        """(φq, φk, v), each (b, h, l, ·) — exposed for distillation losses. ``offset`` is the
        absolute position of the first token (tokens already in the state), for position-aware maps."""
        _, _, v, fq, fk = self._qkv_features(hidden_states, position_embeddings, offset)
        return fq, fk, v

    def _window_kwargs(self) -> dict:
        return {"scaling": self.scaling, "window": self.window, "gamma": torch.sigmoid(self.window_factor), "eps": self.eps}

    def attention_weights(self, hidden_states, position_embeddings=None, mask=None):
        """The materialised (b, h, l, l) mixing matrix for this input (quadratic form)."""
        return self.forward_quadratic(hidden_states, position_embeddings, mask)[1]

    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), weights (b, h, l, l)) through the materialised form — for
        attention transfer, which needs both and runs on short blocks."""
        if self.window:
            q, k, v, fq, fk = self._qkv_features(hidden_states, position_embeddings)
            y, _, weights = window_linear_attention(q, k, v, fq, fk, mask=mask, return_weights=True, **self._window_kwargs())
            return self.merge_heads(y), weights
        fq, fk, v = self.features(hidden_states, position_embeddings)
        y, weights = linear_attention_quadratic(fq, fk, v, mask, eps=self.eps)
        return self.merge_heads(y), weights

    def _step_features(self, fmap, x, seen: int):
        step = getattr(fmap, "step", None)
        if step is not None:
            return step(x)
        if seen is None and getattr(fmap, "uses_positions", False):
            raise ValueError(f"{type(fmap).__name__} needs the token's position: pass step(..., seen=)")
        positions = None if seen is None else torch.arange(seen, seen + 1, device=x.device)  # position-aware maps
        return fmap(x[:, :, None], positions)[:, :, 0].float()

    def fuse_input_linears(self) -> bool:
        """Also stack the query and key Hedgehog maps' parameters (one buffer each for weights
        and biases, values unchanged): a decode step then computes both maps' features in one
        matmul and one softmax."""
        fused = super().fuse_input_linears()
        maps = (self.feature_map_q, self.feature_map_k)
        if self.__dict__.get("_fused_maps") is None and all(type(m) is HedgehogMap and m.activation == "softmax" for m in maps):
            self.__dict__["_fused_maps"] = StackedMaps(self, maps)
            fused = True
        return fused

    def _qk_index(self, device) -> torch.Tensor:
        """(2h,) rows of the (h + kv) roped q/k heads: every query head, then each one's key head."""
        cached = self.__dict__.get("_qk_rows")
        if cached is None or cached.device != torch.device(device):
            cached = torch.cat([torch.arange(self.num_heads, device=device), self.num_heads + self.kv_index(device)])
            self.__dict__["_qk_rows"] = cached
        return cached

    def step(self, hidden_states, position_embeddings, states: dict, mask=None, seen: int | None = None, traced_parts: int = 0):
        """One token against the carried state (see ``AttentionLikeMixer``) in as few ops as the
        math allows — q and k roped together, both feature maps in one matmul when they are
        stacked (``fuse_input_linears``): (output, {state name: new state}). An eager step updates
        the state in place (the cache owns it: rollback snapshots and benchmark copies are
        clones); a traced one returns a new one. ``seen`` is read only by a position-aware
        feature map (see ``can_trace_step``)."""
        b = hidden_states.shape[0]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        traced = traced_parts > 0
        fused = self.__dict__.get("_fused_inputs")
        if fused is not None and fused.valid(trusted=traced):  # rows q | k | v (input_linears' order)
            qkv = fused.matmul(hidden_states, traced_parts)
        else:
            qkv = torch.cat([call_linear(getattr(self, n), hidden_states, traced_parts) for n in ("q_proj", "k_proj", "v_proj")], -1)
        qkv = qkv.view(b, h + 2 * kv, d)
        qk, v = qkv[:, : h + kv], qkv[:, h + kv :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], 1)
        if self.use_rope and position_embeddings is not None and self.rotary_dim:
            if self.rotary_dim == d:
                qk = self.context.rope_step(qk, *position_embeddings, traced=traced)
            else:  # partial rotary (Phi, GPT-NeoX): the general form over (b, heads, 1, d)
                qk = apply_rotary(qk[:, :, None], *position_embeddings, self.rotary_dim)[:, :, 0]
        heads = qk.index_select(1, self._qk_index(qk.device))  # (b, 2h, d): q heads, then k heads repeated
        maps = self.__dict__.get("_fused_maps")
        if maps is not None and maps.valid(trusted=traced):
            features = hedgehog_softmax_step(heads, maps.weight.buffer, maps.bias.buffer)
            fq, fk = features[:, :h], features[:, h:]
        else:
            fq = self._step_features(self.feature_map_q, heads[:, :h], seen)
            fk = self._step_features(self.feature_map_k, heads[:, h:], seen)
        v = self.repeat_kv(v, 1).float()
        if mask is not None:  # a padded token adds nothing to the state
            m = mask.to(torch.float32).view(-1, 1, 1)
            fk, v = fk * m, v * m
        # in place in eager steps (no allocation); a traced step returns new states (no copy-back)
        y, state = linear_attention_step(fq, fk, v, states["linear"], eps=self.eps, inplace=not traced)
        if y.dtype != hidden_states.dtype:
            y = y.to(hidden_states.dtype)
        return call_linear(self.o_proj, y.view(b, 1, h * d), traced_parts), {"linear": state}

    def can_trace_step(self, layer) -> bool:
        """Can a compiled decode step trace ``step`` for this cache layer? (Not with a
        position-aware feature map: the trace must not read ``seen``.)"""
        maps = (self.feature_map_q, self.feature_map_k)
        return super().can_trace_step(layer) and not any(getattr(m, "uses_positions", False) for m in maps)

    def can_step(self, layer) -> bool:
        return not self.window and "linear" in layer.states

    def forward(self, hidden_states, *args, position_embeddings=None, **kwargs):
        b, l, _ = hidden_states.shape
        layer = self.cache_layer(kwargs)
        if l == 1 and layer is not None and self.can_step(layer):
            return self.step_layer(hidden_states, position_embeddings, layer, self.padding_mask(1)), None
        q, k, v, fq, fk = self._qkv_features(hidden_states, position_embeddings, offset=0 if layer is None else layer.seen)
        mask = self.padding_mask(l)
        if self.window:  # blocks of chunk_size queries against [window cache; block]: linear in l
            state = None if layer is None else layer.states.get("window")
            outs, opts = [], self._window_kwargs()
            pieces = [t.split(self.chunk_size, dim=2) for t in (q, k, v, fq, fk)]  # split: linear-time backward
            masks = [None] * len(pieces[0]) if mask is None else mask.split(self.chunk_size, dim=1)
            for qc, kc, vc, fqc, fkc, mc in zip(*pieces, masks):
                o, state = window_linear_attention(qc, kc, vc, fqc, fkc, mask=mc, state=state, **opts)
                outs.append(o)
            if layer is not None:
                layer.states["window"] = state
                layer.advance(l)
            return self.merge_heads(torch.cat(outs, 2)), None
        state = None if layer is None else layer.states.get("linear")
        y, state = linear_attention_chunked(fq, fk, v, mask, state, chunk_size=self.chunk_size, eps=self.eps)
        if layer is not None:
            layer.states["linear"] = state
            layer.advance(l)
        return self.merge_heads(y), None

