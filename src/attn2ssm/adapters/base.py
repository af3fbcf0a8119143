"""What every teacher family adapter provides.

An adapter knows, for one family of Hugging Face decoders, where the attention modules live,
how to read their projection weights in one canonical layout, and how to recompute the
teacher's attention probabilities for a given layer input. Nothing else in attn2ssm looks
inside a teacher's attention module.

Canonical layout (whatever the family stores):
  q: (num_heads * head_dim, hidden)      k, v: (num_kv_heads * head_dim, hidden)
  o: (hidden, num_heads * head_dim)      biases: 1-D or None
i.e. ``nn.Linear`` weight layout (out_features, in_features); GPT-2's Conv1D is transposed
and its fused c_attn split, GPT-NeoX's per-head interleaved query_key_value is de-interleaved,
Phi's separate q/k/v/dense are read as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionGeometry:
    """Shapes and positional scheme of one attention layer."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # leading dims of each head that RoPE rotates; head_dim = full RoPE, 0 = no RoPE
    scaling: float  # softmax temperature the teacher applies to q·k (1/sqrt(head_dim) for most)
    sliding_window: int | None = None  # this layer's window (tokens), None = global
    softcap: float | None = None  # attention-logit soft-capping (Gemma-2), None = none
    qkv_bias: bool = False
    o_bias: bool = False
    has_qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Gemma-3)

    @property
    def num_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AttentionWeights:
    """A layer's projections in canonical (out_features, in_features) layout."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: nn.Module | None = None  # Gemma-3 style per-head norms, applied before RoPE
    k_norm: nn.Module | None = None
