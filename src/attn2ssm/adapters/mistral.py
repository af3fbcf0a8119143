"""Mistral: Llama without biases, plus one ``config.sliding_window`` shared by every layer.

MistralModel builds a sliding-window mask for all layers whenever ``config.sliding_window``
is set (it ignores ``layer_types``), so the window is not per layer here.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class MistralAdapter(Adapter):
    family = "mistral"
    model_types = ("mistral",)

    def biases(self, config) -> tuple[bool, bool]:
        return False, False  # MistralAttention hard-codes bias=False

    def sliding_window(self, config, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)
