"""A head-level hybrid layer: a few KV groups keep the teacher's softmax attention, the rest is
LoLCATs-style linear attention (``linear_attention``, window + linear or linear alone).

"Retrieval-Aware Distillation" (Bick, Xing, Gu, ICML 2026) keeps about 2 % of a teacher's
attention heads, chosen by a synthetic retrieval probe, inside otherwise converted layers. Here
the unit is a KV group (with GQA the kv head and the query heads that read it: SmolLM2-135M has 3
groups of 3 query heads per layer), because a kept group's cost is its keys and values. In a layer listed in
``softmax_kv_heads``:

    y_j = softmax(q_j Kᵀ · scaling + causal mask) V        query head j of a kept group (exact,
                                                             over every token before it)
    y_j = the linear_attention mixer's head j               every other query head
    out = o_proj([y_0 … y_{h−1}])                            heads in their original order

The kept groups' keys and values (RoPE applied, the teacher's own) grow in the layer's cache state
(``KeptKV``: only those groups, with the keys' padding mask); the other heads carry the linear
mixer's state as always. Prefill runs PyTorch's SDPA over [cache; new tokens], a one-token decode
the same with l = 1, so prefill, chunked prefill and decode are one computation. With every group
kept the layer is the teacher's attention; with none it is the plain mixer (tests hold both).

Option ``softmax_kv_heads``: ``{layer index: [kv group, …]}`` for the whole model (a mixer kind's
options are shared by its layers; JSON turns the keys into strings, both are read), so one
mixer_options entry records every layer's kept groups. ``head_level_plan`` builds the layer plan
and options from a choice of groups (distill/retrieval_probe.py makes that choice). The linear
branch still runs over the kept heads (its state for them is unused): the parent's code is reused
as it is, at a cost of one head's linear state per kept query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.linear_attention import LinearAttentionMixer
from attn2ssm.ops.softmax_attention import softmax_attention, softmax_attention_weights

KIND = "linear_attention_heads"
BASE_KIND = "linear_attention"


@dataclass
class KeptKV:
    """The kept groups' keys and values so far, (b, g, T, d) each, and their (b, T) padding mask
    (None while every key is real)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None


def parse_kept_heads(
    value, num_layers: int | None = None, num_kv_heads: int | None = None
) -> dict[int, list[int]]:
    """``{layer: sorted groups}`` from a ``softmax_kv_heads`` value (keys int or digit strings); a
    ConfigError (one line) for a malformed entry, a layer or group out of range, or a repeat."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"softmax_kv_heads={value!r} is not a mapping",
            'use e.g. softmax_kv_heads: {"5": [1], "17": [0, 2]}',
        )
    out: dict[int, list[int]] = {}
    for key, groups in value.items():
        layer = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else None
        ok_groups = isinstance(groups, (list, tuple)) and all(
            isinstance(g, int) and not isinstance(g, bool) for g in groups
        )
        if layer is None or not ok_groups or len(set(groups)) != len(groups):
            raise ConfigError(
                f"softmax_kv_heads entry {key!r}: {groups!r} is not a layer index with a list of distinct kv groups",
                'use e.g. softmax_kv_heads: {"5": [1], "17": [0, 2]}',
            )
        if num_layers is not None and not 0 <= layer < num_layers:
            raise ConfigError(
                f"softmax_kv_heads names layer {layer}, outside 0..{num_layers - 1}",
                "list the student's layers",
            )
        bad = [g for g in groups if num_kv_heads is not None and not 0 <= g < num_kv_heads]
        if bad or any(g < 0 for g in groups):
            raise ConfigError(
                f"softmax_kv_heads layer {layer} lists kv groups {bad or groups} outside 0..{(num_kv_heads or 1) - 1}",
                "list kv head (group) indices of that layer",
            )
        if groups:
            out[layer] = sorted(groups)
    return out


def list_kept(kept: dict) -> str:
    """'layer 3: [1], layer 7: [0, 2]' for kept KV groups by layer (keys int or str), '' for none."""
    return ", ".join(f"layer {i}: {g}" for i, g in kept.items())


def head_level_plan(
    plan: list[str], options: dict | None, kept: dict[int, list[int]]
) -> tuple[list[str], dict]:
    """The layer plan and mixer options (by kind) of a head-level hybrid: ``plan``'s
    ``linear_attention`` layers listed in ``kept`` become ``linear_attention_heads`` with the same
    options plus ``softmax_kv_heads``. A ConfigError if a listed layer is not a linear_attention layer."""
    wrong = [i for i in kept if not 0 <= i < len(plan) or plan[i] != BASE_KIND]
    if wrong:
        raise ConfigError(
            f"kept heads in layers {sorted(wrong)}, which are not linear_attention layers of the plan",
            "keep heads only in linear_attention layers (student.mixer: linear_attention)",
        )
    options = dict(options or {})
    new_plan = [KIND if i in kept else kind for i, kind in enumerate(plan)]
    by_kind = {BASE_KIND: options}
    if kept:
        by_kind[KIND] = {**options, "softmax_kv_heads": {str(i): list(g) for i, g in sorted(kept.items())}}
    return new_plan, by_kind


class KeptHeadsMixer(LinearAttentionMixer):
    """See the module docstring. Options: ``softmax_kv_heads`` and every ``linear_attention`` option."""

    mixer_type = KIND

    def __init__(self, geometry: dict, layer_idx: int, softmax_kv_heads: dict | None = None, **options):
        super().__init__(geometry, layer_idx, **options)
        groups = parse_kept_heads(softmax_kv_heads, None, self.num_kv_heads).get(layer_idx, [])
        if groups and (geometry.get("softcap") or geometry.get("sliding_window")):
            raise ConfigError(
                f"layer {layer_idx} keeps softmax heads, but its attention is soft-capped or windowed",
                "keep heads only in global attention layers without soft-capping",
            )
        self.kept_groups = groups
        # the number of this layer's KV groups that keep a full cache (the KV-fraction report reads it)
        self.kv_heads_kept = len(groups)
        per_group = self.num_heads // self.num_kv_heads
        self.kept_query_heads = [g * per_group + j for g in groups for j in range(per_group)]
        self._kept_out = None  # the kept heads' outputs (b, hk, l, d), waiting for merge_heads

    # -- the kept heads ------------------------------------------------------------------------
    def _kept_qkv(self, hidden_states, position_embeddings):
        """q (b, hk, l, d) of the kept query heads, k and v (b, gk, l, d) of the kept groups: the
        teacher's projections with its RoPE (whatever the linear branch's ``rope`` option)."""
        q, k, v = self.project_heads(hidden_states, position_embeddings)
        dev = q.device
        qi = torch.tensor(self.kept_query_heads, device=dev)
        gi = torch.tensor(self.kept_groups, device=dev)
        return (
            q.index_select(2, qi).transpose(1, 2),
            k.index_select(2, gi).transpose(1, 2),
            v.index_select(2, gi).transpose(1, 2),
        )

    def _softmax_heads(self, hidden_states, position_embeddings, layer) -> torch.Tensor:
        """The kept heads' outputs over [cached keys; these tokens'], the cache state extended."""
        q, k, v = self._kept_qkv(hidden_states, position_embeddings)
        mask = self.padding_mask(q.shape[2])
        past = None if layer is None else layer.states.get("softmax_kv")
        if past is not None:
            if mask is not None or past.mask is not None:
                ones = torch.ones(k.shape[0], k.shape[2], dtype=torch.long, device=k.device)
                old = (
                    past.mask
                    if past.mask is not None
                    else torch.ones_like(past.k[:, 0, :, 0], dtype=torch.long)
                )
                mask = torch.cat([old.to(ones.dtype), ones if mask is None else mask.to(ones.dtype)], 1)
            k, v = torch.cat([past.k, k.to(past.k.dtype)], 2), torch.cat([past.v, v.to(past.v.dtype)], 2)
        if layer is not None:
            layer.states["softmax_kv"] = KeptKV(k, v, mask)
        return softmax_attention(q, k, v, scaling=self.scaling, key_mask=mask)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """As the parent's, with the kept heads' softmax outputs put in their places first."""
        kept, self._kept_out = self._kept_out, None
        if kept is not None:
            idx = torch.tensor(self.kept_query_heads, device=y.device)
            y = y.index_copy(1, idx, kept.to(y.dtype))
        return super().merge_heads(y)

    # -- the forms -----------------------------------------------------------------------------
    def can_step(self, layer) -> bool:
        # a kept layer's one-token decode is ``mix`` over one token (its softmax heads read the cache)
        return not self.kept_groups and super().can_step(layer)

    def mix(self, hidden_states, position_embeddings, layer):
        if not self.kept_groups:
            return super().mix(hidden_states, position_embeddings, layer)
        self._kept_out = self._softmax_heads(hidden_states, position_embeddings, layer)
        try:
            return super().mix(hidden_states, position_embeddings, layer)
        finally:
            self._kept_out = None

    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output, weights (b, h, l, l)): the kept heads' rows are their exact softmax weights."""
        if not self.kept_groups:
            return super().forward_quadratic(hidden_states, position_embeddings, mask)
        q, k, v = self._kept_qkv(hidden_states, position_embeddings)
        w = softmax_attention_weights(q, k, scaling=self.scaling, key_mask=mask)
        per_group = len(self.kept_query_heads) // len(self.kept_groups)
        self._kept_out = w @ v.float().repeat_interleave(per_group, dim=1)
        try:
            out, weights = super().forward_quadratic(hidden_states, position_embeddings, mask)
        finally:
            self._kept_out = None
        idx = torch.tensor(self.kept_query_heads, device=weights.device)
        return out, weights.index_copy(1, idx, w.to(weights.dtype))
