"""MOHAWK's Phi-Mamba mixer ("Transformers to SSMs: Distilling Quadratic Knowledge to Subquadratic
Models", Bick et al. 2024, arXiv 2408.10189): a Mamba-2 (SSD) mixer whose decay is read from the input.

Everything but the decay is ``Mamba2Mixer`` (mamba2.py: the attention weight mapping, the conv over
[x, B, C], GQA, the gate, D): there is no Δ and no A; instead, per head and token,

    a_t = −softplus(W_a u_t + b_a)                      (log-decay ≤ 0, ``a_proj``)
    h_t = exp(a_t)·h_{t−1} + x_t ⊗ B_t,   y_t = h_t C_t + D ⊙ x_t

with no activation after the conv and no norm by default (Phi-Mamba's). ``a_proj`` starts with a
zero weight and a bias drawn from ``a_init_range`` (−8 to −7: α = exp(−softplus(b)) ≈ 0.9995), so a
converted layer starts close to linear attention. MOHAWK's matrix-orientation stage matches its
materialised mixing matrix (``forward_quadratic``) to the teacher's attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.mixers.mamba2 import Mamba2Mixer
from attn2ssm.mixers.options import NonNegativeInt, PositiveInt


class DiscreteMamba2Mixer(Mamba2Mixer):
    """Input-projected decay (no Δ, no A), identity conv without activation, no norm,
    identity-initialised gate, D skip."""

    mixer_type = "discrete_mamba2"
    input_linears = ("q_proj", "k_proj", "v_proj", "gate", "a_proj")

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        d_conv: NonNegativeInt = 4,
        conv_activation: str | None = "none",
        gate: bool = True,
        norm: bool = False,
        norm_eps: float = 1e-6,
        D: bool = True,
        a_init_range: tuple[float, float] = (-8.0, -7.0),
        rope: str = "none",
        chunk_size: PositiveInt = 64,
        sanity: bool = False,
        D_init: float = 0.0,
    ):
        super().__init__(
            geometry,
            layer_idx,
            d_conv=d_conv,
            conv_activation=conv_activation,
            gate=gate,
            norm=norm,
            norm_eps=norm_eps,
            D=D,
            a_init_range=a_init_range,
            rope=rope,
            chunk_size=chunk_size,
            sanity=sanity,
            D_init=D_init,
        )

    def make_decay_parameters(self, sanity: bool) -> None:
        """The decay's input projection W_a, b_a (none in sanity mode: a = 0)."""
        self.a_proj = None if sanity else nn.Linear(self.hidden_size, self.num_heads, bias=True)

    @torch.no_grad()
    def init_decay_parameters(self) -> None:
        if self.a_proj is None:
            return
        # Little decay at init (α = exp(−softplus(b)) ≈ 0.9995): close to linear attention.
        self.a_proj.weight.zero_()
        lo, hi = self.a_init_range
        self.a_proj.bias.copy_(torch.rand(self.num_heads) * (hi - lo) + lo)

    def _decay(self, u, inputs=None):
        """(log-decay a = −softplus(W_a u + b_a) (b, l, h), None: the input is not scaled)."""
        if self.sanity:
            return u.new_zeros(u.shape[0], u.shape[1], self.num_heads), None
        return -F.softplus((self.a_proj(u) if inputs is None else inputs["a_proj"]).float()), None
