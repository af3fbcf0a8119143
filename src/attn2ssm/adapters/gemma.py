"""Gemma, Gemma-2 and Gemma-3 (text): Llama layout with each generation's extras.

- gemma:  head_dim set explicitly (often != hidden/heads), 1/sqrt(head_dim).
- gemma2: scaling 1/sqrt(query_pre_attn_scalar), tanh soft-capping of attention logits,
          local (sliding) / global layers from ``config.layer_types``.
- gemma3: per-head q_norm/k_norm (RMSNorm with 1+weight) before RoPE, local/global layers
          with *different* RoPE (local base 10k, global 1M), one cos/sin pair per layer type.
          Gemma3Attention does not pass a softcap to its attention function, so
          ``attn_logit_softcapping`` in a Gemma-3 config has no effect and is reported as None.
Bidirectional variants (``use_bidirectional_attention``, embedding models) are rejected.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter
from attn2ssm.adapters.registry import register_adapter
from attn2ssm.errors import UnsupportedModelError


@register_adapter
class GemmaAdapter(Adapter):
    family = "gemma"
    model_types = ("gemma",)

    def validate(self, config) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(
                f"{config.model_type} with use_bidirectional_attention=True is an encoder, not a causal decoder",
                "use a causal (generative) Gemma checkpoint as the teacher",
            )


@register_adapter
class Gemma2Adapter(GemmaAdapter):
    family = "gemma2"
    model_types = ("gemma2",)
    uses_layer_types = True

    def scaling(self, config, layer_idx: int, head_dim: int) -> float:
        return config.query_pre_attn_scalar**-0.5

    def softcap(self, config) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)


@register_adapter
class Gemma3Adapter(Gemma2Adapter):
    family = "gemma3"
    model_types = ("gemma3_text",)
    qk_norm_attrs = ("q_norm", "k_norm")

    def softcap(self, config) -> float | None:
        return None  # Gemma3Attention never hands attn_logit_softcapping to the attention function

    def _call_rotary(self, model, hidden_states, position_ids, layer_idx):
        layer_type = self._base(model).config.layer_types[layer_idx]
        return self._rotary_module(model)(hidden_states, position_ids, layer_type)
