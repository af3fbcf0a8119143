"""Qwen2: Llama with q/k/v biases (no o bias) and optional per-layer sliding windows.

Qwen2Config turns ``use_sliding_window``/``max_window_layers`` into ``layer_types``; the model
uses a windowed mask exactly on "sliding_attention" layers.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class Qwen2Adapter(Adapter):
    family = "qwen2"
    model_types = ("qwen2",)
    uses_layer_types = True

    def biases(self, config) -> tuple[bool, bool]:
        return True, False  # Qwen2Attention hard-codes these, whatever the config says
