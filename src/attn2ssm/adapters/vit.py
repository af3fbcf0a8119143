"""Vision transformers: ViT and DeiT (``ViTForImageClassification``, ``DeiTForImageClassification``
and their base models), the encoder-side teachers of CAB's vision half.

Attention lives at ``vit.layers[i].attention`` (``deit.…`` for DeiT; ``encoder.layer`` in
transformers < 5.24) with separate q/k/v/o ``nn.Linear`` projections, non-causal, no RoPE (positions are added to the
patch embeddings), scaling 1/√head_dim, q/k/v biases when ``config.qkv_bias``, an o bias always.
Tokens are [prefix tokens, patches]: one class token for ViT, class + distillation token for
DeiT (``num_prefix_tokens``); the classifier reads token 0. The attention modules carry no
``layer_idx`` (every layer has the same geometry), so ``layer_geometry`` uses layer 0.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.adapters.base import AttentionGeometry
from attn2ssm.adapters.common import Adapter, RotaryPair
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class ViTAdapter(Adapter):
    family = "vit"
    model_types = ("vit", "deit")
    encoder = True  # not a causal LM teacher: listed by supported_families(encoders=True)
    layers_attr = "layers"
    attn_attr = "attention"

    def _base_name(self, model: nn.Module) -> str:
        return getattr(model.config, "model_type", "vit")

    def _base_prefix(self, model: nn.Module) -> str:
        name = self._base_name(model)
        return name + "." if isinstance(getattr(model, name, None), nn.Module) else ""

    def _base(self, model: nn.Module) -> nn.Module:
        return getattr(model, self._base_name(model)) if self._base_prefix(model) else model

    def _layers_path(self, model: nn.Module) -> str:
        return "encoder.layer" if hasattr(self._base(model), "encoder") else "layers"

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return self._base(model).get_submodule(self._layers_path(model))

    def attention_module_paths(self, model: nn.Module) -> list[str]:
        prefix = f"{self._base_prefix(model)}{self._layers_path(model)}"
        return [f"{prefix}.{i}.{self.attn_attr}" for i in range(len(self.decoder_layers(model)))]

    def num_prefix_tokens(self, config) -> int:
        """Tokens before the patches: the class token (+ DeiT's distillation token)."""
        return 2 if config.model_type == "deit" else 1

    def num_patches(self, config) -> int:
        return (config.image_size // config.patch_size) ** 2

    def rotary_dim(self, config, head_dim: int) -> int:
        return 0

    def biases(self, config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), True

    def layer_geometry(self, attn: nn.Module) -> AttentionGeometry:
        return self.geometry(attn.config, 0)

    def rotary_embeddings(self, model, hidden_states, position_ids, layer_idx) -> RotaryPair | None:
        return None

    def attention_probs(
        self, attn, hidden_states, position_embeddings=None, attention_mask=None
    ) -> torch.Tensor:
        """Non-causal softmax probabilities (b, h, l, l), float32 (the base class applies a causal mask)."""
        q, k = self.qk(attn, hidden_states, None)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.layer_geometry(attn).scaling
        return torch.softmax(scores, dim=-1)

    def student_geometry(self, config, layer_idx: int) -> dict:
        """What an encoder mixer needs to replace layer ``layer_idx``'s attention."""
        return {
            **self.geometry(config, layer_idx).to_dict(),
            "num_prefix_tokens": self.num_prefix_tokens(config),
            "num_patches": self.num_patches(config),
        }
