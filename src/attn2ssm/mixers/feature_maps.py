"""Feature maps φ for linear attention: (b, h, l, d) → (b, h, l, f), non-negative.

Each map is an nn.Module built by ``build_feature_map(name, num_heads, head_dim, **options)``.
Trainable maps (Hedgehog, T2R) arrive with the linear-attention family; the fixed maps here
are enough to run the pipeline end to end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError


class EluPlusOne(nn.Module):
    """φ(x) = 1 + ELU(x) (Katharopoulos et al. 2020); f = d."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.feature_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0


class ReLUMap(nn.Module):
    """φ(x) = ReLU(x) (Kasai et al. 2021); f = d. Rows may be all-zero: the op's eps keeps it finite."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.feature_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


FEATURE_MAPS: dict[str, type[nn.Module]] = {"elu": EluPlusOne, "relu": ReLUMap}


def build_feature_map(name: str, num_heads: int, head_dim: int, **options) -> nn.Module:
    if name not in FEATURE_MAPS:
        raise ConfigError(
            f"unknown feature map '{name}'", f"choose one of: {', '.join(sorted(FEATURE_MAPS))}"
        )
    return FEATURE_MAPS[name](num_heads, head_dim, **options)
