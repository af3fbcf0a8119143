"""Llama (and SmolLM2, TinyLlama, … — anything with model_type "llama").

The base Adapter already is the Llama layout: separate q/k/v/o projections with optional
``attention_bias``, full RoPE from ``model.rotary_emb``, GQA, 1/sqrt(head_dim), no window.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class LlamaAdapter(Adapter):
    family = "llama"
    model_types = ("llama",)
