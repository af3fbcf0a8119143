"""GPT-2: Conv1D projections (weight stored (in, out)), fused c_attn, learned absolute positions.

No RoPE (rotary_dim 0, ``rotary_embeddings`` returns None): positions enter through ``wpe``
before the first block, so the attention input already carries them. Scaling is
1/sqrt(head_dim) if ``scale_attn_weights`` (else 1), further divided by (layer_idx + 1) if
``scale_attn_by_inverse_layer_idx``. ``reorder_and_upcast_attn`` only changes rounding.
Only the self-attention (``attn``) is adapted, never the optional cross-attention.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.adapters.base import AttentionGeometry, AttentionWeights
from attn2ssm.adapters.common import Adapter, RotaryPair
from attn2ssm.adapters.registry import register_adapter


def _conv1d_weight(conv: nn.Module) -> torch.Tensor:
    """Conv1D keeps (in, out); canonical is nn.Linear's (out, in)."""
    return conv.weight.detach().t().contiguous()


@register_adapter
class GPT2Adapter(Adapter):
    family = "gpt2"
    model_types = ("gpt2",)
    base_attr = "transformer"
    layers_attr = "h"
    attn_attr = "attn"
    learned_positions = True  # wpe

    def head_dim(self, config) -> int:
        return config.hidden_size // config.num_attention_heads

    def num_kv_heads(self, config) -> int:
        return config.num_attention_heads

    def rotary_dim(self, config, head_dim: int) -> int:
        return 0

    def scaling(self, config, layer_idx: int, head_dim: int) -> float:
        scaling = head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scaling /= float(layer_idx + 1)
        return scaling

    def biases(self, config) -> tuple[bool, bool]:
        return True, True

    def read_weights(self, attn: nn.Module) -> AttentionWeights:
        hidden = attn.embed_dim
        q, k, v = _conv1d_weight(attn.c_attn).split(hidden, dim=0)  # each (hidden, hidden)
        qb, kb, vb = attn.c_attn.bias.detach().split(hidden)
        return AttentionWeights(
            q=q.clone(),
            k=k.clone(),
            v=v.clone(),
            o=_conv1d_weight(attn.c_proj),
            q_bias=qb.clone(),
            k_bias=kb.clone(),
            v_bias=vb.clone(),
            o_bias=attn.c_proj.bias.detach().clone(),
        )

    def rotary_embeddings(self, model, hidden_states, position_ids, layer_idx) -> RotaryPair | None:
        return None

    def project_qkv(
        self, attn: nn.Module, hidden_states: torch.Tensor, geometry: AttentionGeometry
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length = hidden_states.shape[:2]
        q, k, v = attn.c_attn(hidden_states).split(attn.split_size, dim=2)  # each (b, l, hidden)
        return tuple(x.view(b, length, -1, geometry.head_dim).transpose(1, 2) for x in (q, k, v))
