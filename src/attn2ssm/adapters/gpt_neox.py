"""GPT-NeoX (Pythia, …): fused, per-head interleaved query_key_value and partial RoPE.

``query_key_value`` produces, for each head in turn, [q_head | k_head | v_head]
(3 * head_dim rows per head), not [all q | all k | all v]; ``read_weights`` de-interleaves it
into the canonical layout. RoPE covers the first ``int(head_dim * rotary_pct)`` dims (stored
as ``rope_parameters["partial_rotary_factor"]`` in transformers v5). No GQA. The parallel
residual lives in the decoder layer and does not change the attention module's input.
"""

from __future__ import annotations

import torch
from torch import nn

from attn2ssm.adapters.base import AttentionGeometry, AttentionWeights
from attn2ssm.adapters.common import Adapter, _bias, _weight, partial_rotary_factor
from attn2ssm.adapters.registry import register_adapter


@register_adapter
class GPTNeoXAdapter(Adapter):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
    base_attr = "gpt_neox"
    attn_attr = "attention"

    def head_dim(self, config) -> int:
        return config.hidden_size // config.num_attention_heads

    def num_kv_heads(self, config) -> int:
        return config.num_attention_heads

    def rotary_dim(self, config, head_dim: int) -> int:
        return int(head_dim * partial_rotary_factor(config))

    def read_weights(self, attn: nn.Module) -> AttentionWeights:
        geometry = self.layer_geometry(attn)
        h, d = geometry.num_heads, geometry.head_dim
        fused = _weight(attn.query_key_value).view(h, 3, d, -1)  # (h, q|k|v, d, hidden)
        q, k, v = (fused[:, i].reshape(h * d, -1).clone() for i in range(3))
        qb = kb = vb = None
        fused_bias = _bias(attn.query_key_value)
        if fused_bias is not None:
            fused_bias = fused_bias.view(h, 3, d)
            qb, kb, vb = (fused_bias[:, i].reshape(h * d).clone() for i in range(3))
        return AttentionWeights(
            q=q, k=k, v=v, o=_weight(attn.dense), q_bias=qb, k_bias=kb, v_bias=vb, o_bias=_bias(attn.dense)
        )

    def project_qkv(
        self, attn: nn.Module, hidden_states: torch.Tensor, geometry: AttentionGeometry
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length = hidden_states.shape[:2]
        qkv = attn.query_key_value(hidden_states).view(b, length, -1, 3 * geometry.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # each (b, h, l, d)
        return q, k, v
