"""The form a hybrid student's kept softmax-attention layers take (``student.kept_attention``).

``teacher`` (the default): the teacher's own attention module, untouched. ``qwen35``: the teacher's
attention in Qwen3.5's form (transformers' ``Qwen3_5Attention``), so that a gated delta-rule hybrid
exports to ``Qwen3_5ForCausalLM`` / llama.cpp's ``qwen35`` exactly (export/native_qwen35.py):

    q = RoPE(RMSNorm_head(W_Q u) · w_q),  k = RoPE(RMSNorm_head(W_K u) · w_k),  v = W_V u
    out = W_O (softmax(q kᵀ / √d) v · sigmoid(W_G u))

— each q and k head RMS-normalised over head_dim (ε: the teacher's ``rms_norm_eps``) *before* RoPE,
as Qwen3.5 does, and the attention output gated per channel by a sigmoid of its own projection of
the layer input. q/k/v/o are the teacher's (same names, same GQA), RoPE, the scaling 1/√d, the
attention implementation and a sliding window (Mistral, Qwen2) are the teacher layer's own.

Initialisation (``init_from_teacher``, called by ``convert``): W_G = 0, so the gate is sigmoid(0) =
1/2 everywhere, and W_O is doubled — exactly the teacher's output. No weight makes an RMSNorm the
identity (it divides each head by its own RMS, which changes every softmax), so the norm weights
start as the least-squares scale that maps the normalised q (k) back to the teacher's, per head
dimension, pooled over heads and tokens: w_p = Σ q_p q̂_p / Σ q̂_p² with q̂ = q / rms(q), measured on
the calibration blocks a run already takes (``set_norm_weights``, from distill/calibration.py). If
rms(q) were the same for every token and head, this is that RMS and the layer is the teacher's
exactly; the spread of rms(q) over tokens is what is lost. Built without calibration data
(``convert`` alone) the weights are 1.

The new parameters (``q_norm``, ``k_norm``, ``g_proj``) belong to the ``mixers`` parameter group
(distill/stages/base.py), so the stages that train the mixers train them too; q/k/v/o stay in
``attention``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from attn2ssm.hf_compat import explicit_cache
from attn2ssm.mixers.base import HeadRMSNorm
from attn2ssm.ops.rope import apply_rotary

TEACHER, QWEN35 = "teacher", "qwen35"
KEPT_ATTENTION = (TEACHER, QWEN35)
# Families whose attention is q/k/v/o Linears, rotate-half RoPE from the model's position_embeddings
# and transformers' attention interface: the forward below is theirs with the norms and the gate added.
QWEN35_FORM_FAMILIES = ("llama", "mistral", "qwen2")
NEW_PARAMETERS = ("q_norm", "k_norm", "g_proj")


class Qwen35FormAttention(nn.Module):
    """A kept attention layer in Qwen3.5's form, made from the teacher family's attention module
    ``attention`` (its projections and settings are taken over as they are). ``rotary_dim``: the
    layer's RoPE dims (its geometry's), ``eps``: the teacher's rms_norm_eps."""

    def __init__(self, attention: nn.Module, num_heads: int, head_dim: int, rotary_dim: int, eps: float):
        super().__init__()
        self.config = attention.config  # the family's: its attention implementation
        self.layer_idx = attention.layer_idx
        self.num_heads, self.head_dim, self.rotary_dim = num_heads, head_dim, rotary_dim
        self.num_key_value_groups = attention.num_key_value_groups
        self.scaling = attention.scaling
        self.attention_dropout = attention.attention_dropout
        self.is_causal = True
        self.sliding_window = getattr(attention, "sliding_window", None)
        if self.sliding_window is None and getattr(self.config, "model_type", None) == "mistral":
            self.sliding_window = getattr(self.config, "sliding_window", None)
        self.q_proj, self.k_proj = attention.q_proj, attention.k_proj
        self.v_proj, self.o_proj = attention.v_proj, attention.o_proj
        self.q_norm = HeadRMSNorm(head_dim, eps)
        self.k_norm = HeadRMSNorm(head_dim, eps)
        self.g_proj = nn.Linear(self.q_proj.in_features, num_heads * head_dim, bias=False)

    @torch.no_grad()
    def init_from_teacher(self) -> None:
        """From the teacher's weights (already in q/k/v/o): the gate at 1/2 with W_O doubled (exact),
        norm weights 1 until ``set_norm_weights``."""
        self.g_proj.weight.zero_()
        self.o_proj.weight.mul_(2.0)
        self.q_norm.weight.fill_(1.0)
        self.k_norm.weight.fill_(1.0)

    @torch.no_grad()
    def set_norm_weights(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """q_norm / k_norm weights from the teacher's pre-RoPE q (…, h, d) and k (…, kv, d): the
        least-squares scale per head dimension (module docstring)."""
        for norm, x in ((self.q_norm, q), (self.k_norm, k)):
            x = x.float().reshape(-1, self.head_dim)
            x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
            w = (x * x_hat).sum(0) / x_hat.pow(2).sum(0).clamp_min(1e-12)
            norm.weight.copy_(w.to(norm.weight.dtype))

    def heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's pre-norm, pre-RoPE q (b, l, h, d) and k (b, l, kv, d) of ``hidden_states``."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        return self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        """As the teacher family's attention forward (returns (output, weights)); the cache is taken
        under any name transformers has given it."""
        cache = explicit_cache(kwargs)
        for name in ("cache", "past_key_values", "layer_past"):
            kwargs.pop(name, None)
        input_shape = hidden_states.shape[:-1]
        q, k = self.heads(hidden_states)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)  # (b, h, l, d): norm, then RoPE
        v = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, cos, sin, self.rotary_dim), apply_rotary(k, cos, sin, self.rotary_dim)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attend(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous() * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(out), weights
