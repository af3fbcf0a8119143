"""The shared ``Adapter`` base class and the teacher's attention-probability math.

The base class implements the Llama layout (``model.layers[i].self_attn`` with separate
q/k/v/o ``nn.Linear`` projections and one ``model.rotary_emb``), because most families are
Llama plus a few differences; a family adapter overrides only the hooks where its teacher
differs (a bias, a window, a scaling rule, a fused projection).

Every method works from the live modules (``attn.q_proj`` etc.) so that recomputed q/k and
probabilities are the teacher's own numbers, not a re-implementation that could drift.
"""

from __future__ import annotations

import copy
from typing import ClassVar

import torch
from torch import nn

from attn2ssm.adapters.base import AttentionGeometry, AttentionWeights
from attn2ssm.adapters.masking import allowed_keys
from attn2ssm.ops.rope import apply_rotary

RotaryPair = tuple[torch.Tensor, torch.Tensor]


def probs_from_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    geometry: AttentionGeometry,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager-attention softmax probabilities from post-RoPE q and k, in float32.

    q: (b, h, l, d); k: (b, kv, l, d) — each kv head is shared by ``num_groups`` consecutive
    query heads (transformers' ``repeat_kv``). Order of operations follows the teachers'
    eager path: scale, soft-cap, mask, softmax. Masked keys get probability exactly 0; a
    query row with no visible key (a padded query) comes out finite, not NaN.
    Returns (b, h, l, l).
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1) if groups > 1 else k  # (b, h, l, d)
    with torch.autocast(q.device.type, enabled=False):  # float32 targets under a bf16/fp16 autocast too
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * geometry.scaling  # (b, h, l, l)
        if geometry.softcap is not None:
            scores = torch.tanh(scores / geometry.softcap) * geometry.softcap
        allowed = allowed_keys(q.shape[-2], geometry.sliding_window, attention_mask, device=q.device)
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        return torch.softmax(scores, dim=-1)


def partial_rotary_factor(config) -> float:
    """Fraction of each head RoPE rotates (v5 keeps it in rope_parameters; NeoX's rotary_pct lands there)."""
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


def _weight(linear: nn.Linear) -> torch.Tensor:
    return linear.weight.detach().clone()


def _bias(linear: nn.Module) -> torch.Tensor | None:
    bias = getattr(linear, "bias", None)
    return None if bias is None else bias.detach().clone()


class Adapter:
    """One teacher family: where attention lives, its weights, its q/k and probabilities.

    Subclasses set ``family`` and ``model_types`` and override the small hooks below
    (``scaling``, ``sliding_window``, ``project_qkv``, …) where their teacher differs from Llama.
    """

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()

    # Where things live, relative to the CausalLM root.
    base_attr: ClassVar[str] = "model"  # CausalLM attribute holding the decoder stack
    layers_attr: ClassVar[str] = "layers"  # decoder stack attribute holding the layer list
    attn_attr: ClassVar[str] = "self_attn"  # decoder layer attribute holding attention
    q_attr, k_attr, v_attr, o_attr = "q_proj", "k_proj", "v_proj", "o_proj"
    qk_norm_attrs: ClassVar[tuple[str, str] | None] = None  # e.g. ("q_norm", "k_norm")
    uses_layer_types: ClassVar[bool] = False  # sliding layers chosen by config.layer_types
    learned_positions: ClassVar[bool] = (
        False  # a table of absolute position embeddings (no row past max_position_embeddings)
    )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(family={self.family!r})"

    # ---- checks -------------------------------------------------------------------------

    def validate(self, config) -> None:
        """Raise UnsupportedModelError for a variant of the family this adapter cannot mirror."""

    # ---- where attention lives ----------------------------------------------------------

    def _base_prefix(self, model: nn.Module) -> str:
        """Path prefix of the decoder stack: "model." for a CausalLM, "" for the bare stack (LlamaModel)."""
        if isinstance(getattr(model, self.base_attr, None), nn.Module):
            return self.base_attr + "."
        return ""

    def _base(self, model: nn.Module) -> nn.Module:
        return getattr(model, self.base_attr) if self._base_prefix(model) else model

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return getattr(self._base(model), self.layers_attr)

    def attention_attr(self) -> str:
        return self.attn_attr

    def attention_module_paths(self, model: nn.Module) -> list[str]:
        """Dotted paths usable with ``model.get_submodule`` (e.g. "model.layers.3.self_attn")."""
        prefix = f"{self._base_prefix(model)}{self.layers_attr}"
        return [f"{prefix}.{i}.{self.attn_attr}" for i in range(len(self.decoder_layers(model)))]

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        return [getattr(layer, self.attn_attr) for layer in self.decoder_layers(model)]

    # ---- geometry -----------------------------------------------------------------------

    def head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def num_kv_heads(self, config) -> int:
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def rotary_dim(self, config, head_dim: int) -> int:
        return head_dim

    def scaling(self, config, layer_idx: int, head_dim: int) -> float:
        return head_dim**-0.5

    def sliding_window(self, config, layer_idx: int) -> int | None:
        if not self.uses_layer_types:
            return None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or layer_types[layer_idx] != "sliding_attention":
            return None
        return getattr(config, "sliding_window", None)

    def softcap(self, config) -> float | None:
        return None

    def biases(self, config) -> tuple[bool, bool]:
        """(qkv_bias, o_bias)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def has_qk_norm(self, config) -> bool:
        return self.qk_norm_attrs is not None

    def geometry(self, config, layer_idx: int) -> AttentionGeometry:
        num_layers = config.num_hidden_layers
        if not 0 <= layer_idx < num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range for {num_layers} layers")
        head_dim = self.head_dim(config)
        qkv_bias, o_bias = self.biases(config)
        return AttentionGeometry(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=self.num_kv_heads(config),
            head_dim=head_dim,
            rotary_dim=self.rotary_dim(config, head_dim),
            scaling=float(self.scaling(config, layer_idx, head_dim)),
            sliding_window=self.sliding_window(config, layer_idx),
            softcap=self.softcap(config),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            has_qk_norm=self.has_qk_norm(config),
        )

    def layer_geometry(self, attn: nn.Module) -> AttentionGeometry:
        """Geometry of a live attention module (every supported module keeps config and layer_idx)."""
        return self.geometry(attn.config, attn.layer_idx)

    # ---- weights ------------------------------------------------------------------------

    def qk_norms(self, attn: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        """The live per-head q/k norm modules, or (None, None)."""
        if self.qk_norm_attrs is None:
            return None, None
        q_name, k_name = self.qk_norm_attrs
        return getattr(attn, q_name, None), getattr(attn, k_name, None)

    def read_weights(self, attn: nn.Module) -> AttentionWeights:
        q, k, v, o = (getattr(attn, name) for name in (self.q_attr, self.k_attr, self.v_attr, self.o_attr))
        q_norm, k_norm = self.qk_norms(attn)
        return AttentionWeights(
            q=_weight(q),
            k=_weight(k),
            v=_weight(v),
            o=_weight(o),
            q_bias=_bias(q),
            k_bias=_bias(k),
            v_bias=_bias(v),
            o_bias=_bias(o),
            q_norm=copy.deepcopy(q_norm) if q_norm is not None else None,
            k_norm=copy.deepcopy(k_norm) if k_norm is not None else None,
        )

    # ---- positions ----------------------------------------------------------------------

    def _rotary_module(self, model: nn.Module) -> nn.Module:
        return self._base(model).rotary_emb

    def _call_rotary(self, model, hidden_states, position_ids, layer_idx) -> RotaryPair:
        return self._rotary_module(model)(hidden_states, position_ids)

    def rotary_embeddings(
        self,
        model: nn.Module,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None,
        layer_idx: int,
    ) -> RotaryPair | None:
        """(cos, sin), each (b, l, rotary_dim): what the model hands layer ``layer_idx``'s attention.

        ``position_ids`` None means 0..l-1 for every row, which is what the teachers use for a
        cache-free forward (they do not shift positions for left padding).
        """
        if position_ids is None:
            b, length = hidden_states.shape[:2]
            position_ids = torch.arange(length, device=hidden_states.device).expand(b, length)
        return self._call_rotary(model, hidden_states, position_ids, layer_idx)

    # ---- q, k and probabilities ---------------------------------------------------------

    def project_qkv(
        self, attn: nn.Module, hidden_states: torch.Tensor, geometry: AttentionGeometry
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw per-head projections (before q/k norm and RoPE), via the teacher's own modules.

        Returns q (b, h, l, d), k (b, kv, l, d), v (b, kv, l, d).
        """
        b, length = hidden_states.shape[:2]

        def heads(linear: nn.Module) -> torch.Tensor:
            return linear(hidden_states).view(b, length, -1, geometry.head_dim).transpose(1, 2)

        return (
            heads(getattr(attn, self.q_attr)),
            heads(getattr(attn, self.k_attr)),
            heads(getattr(attn, self.v_attr)),
        )

    def qk(
        self, attn: nn.Module, hidden_states: torch.Tensor, position_embeddings: RotaryPair | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (b, h, l, d) and k (b, kv, l, d) after q/k norms and RoPE, as the teacher has them."""
        geometry = self.layer_geometry(attn)
        q, k, _ = self.project_qkv(attn, hidden_states, geometry)
        q_norm, k_norm = self.qk_norms(attn)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        if geometry.rotary_dim:
            if position_embeddings is None:
                raise ValueError(f"{self.family} uses RoPE: pass position_embeddings=(cos, sin)")
            cos, sin = position_embeddings
            q = apply_rotary(q, cos, sin, geometry.rotary_dim)
            k = apply_rotary(k, cos, sin, geometry.rotary_dim)
        return q, k

    def attention_probs(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: RotaryPair | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The teacher's eager attention probabilities (b, h, l, l), float32.

        ``hidden_states`` is the attention module's input (already normed); ``attention_mask``
        is an optional (b, l) 0/1 key-padding mask. Gradients flow if enabled; wrap the call
        in ``torch.no_grad()`` when the probabilities are only targets.
        """
        q, k = self.qk(attn, hidden_states, position_embeddings)
        return probs_from_qk(q, k, self.layer_geometry(attn), attention_mask)
