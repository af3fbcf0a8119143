"""The recurrent state of causal linear attention, apart from its forms so that both the PyTorch
forms (ops/linear_attention.py) and fla's adapter (ops/fla.py) can build it without importing each
other."""

from dataclasses import dataclass

import torch


@dataclass
class LinearAttentionState:
    """Running sums of one causal linear-attention layer.

    kv: (b, h, f, d) = Σ φ(k_s) v_sᵀ    k_sum: (b, h, f) = Σ φ(k_s)
    (with a decay λ_h, each term weighted λ_h^(t−s), t the last position seen)
    """

    kv: torch.Tensor
    k_sum: torch.Tensor

    @classmethod
    def zeros(cls, b: int, h: int, f: int, d: int, device=None) -> "LinearAttentionState":
        return cls(
            torch.zeros(b, h, f, d, device=device, dtype=torch.float32),
            torch.zeros(b, h, f, device=device, dtype=torch.float32),
        )
