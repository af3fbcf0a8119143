"""Mamba (selective scan, per-channel decay) as a drop-in for a teacher attention module,
initialised from it ("Mamba in the Llama", Algorithm 1 and its Mamba-1 release).

Weights: C ← W_Q (scaled by the teacher's 1/√d), B ← W_K, x ← W_V, out ← W_O, kept under the
teacher's names (q_proj = C, k_proj = B, v_proj = x, o_proj = out). GQA: x and B keep the kv
width and are repeated over each query group; C keeps the query width. The value channels
(h·head_dim of them) are split into groups of ``d_state``; group g reads the g-th d_state-wide
slice of its head's key and query as B and C (``d_state`` is capped at head_dim; None means
head_dim). ``d_state = head_dim`` gives one group per head —
full linearised attention at init; ``d_state = 16`` (the default) is Mamba in the Llama's released
layout (state = channels × 16). ``expand`` (N' in the paper) runs N' copies of each group with
their own Δ and A and sums them: the state grows N'-fold.

Per token, with u the layer input:
    x = SiLU(conv(repeat(W_V u)))        (depthwise causal conv, passes the token at init)
    Δ = softplus(W_up W_down u + b_Δ)    (one per channel and copy; low-rank, from the layer input)
    h_t = exp(Δ_t A) ⊙ h_{t−1} + Δ_t B_t x_t,   y_t = C_t h_t + D ⊙ x_t,   out = W_O (y ⊙ SiLU(W_z u + b_z))

``A_init`` (as CAB): every A starts at that small negative value instead, so exp(Δ·A) ≈ 1.

``sanity=True`` (needs expand 1): Δ = 1, A = 0, no conv / gate / D: y_t = Σ_{s≤t} (C_t·B_s) x_s,
which with ``d_state = head_dim`` is linearised attention exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.options import NonNegativeInt, PositiveFloat, PositiveInt
from attn2ssm.mixers.ssm_common import (
    A_log_identity,
    CausalConv,
    ConvRecurrence,
    apply_conv,
    check_activation,
    conv_step,
    dt_bias_init,
    init_shared_parameters,
    store_states,
)
from attn2ssm.mixers.taps import Tap
from attn2ssm.ops.selective_scan import selective_scan_chunked, selective_scan_step


class MambaMixer(ConvRecurrence, AttentionLikeMixer):
    mixer_type = "mamba"
    input_linears = ("q_proj", "k_proj", "v_proj", "gate", "dt_down")

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        d_state: PositiveInt | None = 16,
        expand: PositiveInt = 1,
        dt_rank: PositiveInt | None = None,
        d_conv: NonNegativeInt = 4,
        conv_activation: str | None = "silu",
        gate: bool = True,
        D: bool = True,
        dt_min: PositiveFloat = 1e-3,
        dt_max: PositiveFloat = 0.1,
        rope: str = "none",
        chunk_size: PositiveInt = 32,
        sanity: bool = False,
        D_init: float = 0.0,
        A_init: float | None = None,
    ):
        super().__init__(geometry, layer_idx)
        self.D_init = D_init
        self.A_log_init = A_log_identity("mamba", A_init)  # None: S4D-real
        self.bc_tap = Tap()  # shows B and C to a stage that hooks it (CAB)
        d = self.head_dim
        d_state = min(d_state or d, d)  # capped at head_dim: a group never spans two heads
        if d % d_state:
            raise ConfigError(
                f"mamba d_state={d_state} does not divide head_dim={d}",
                f"use a divisor of {d} (e.g. 16) or d_state: null for head_dim",
            )
        if expand < 1 or (sanity and expand != 1):
            raise ConfigError(
                f"mamba expand={expand} is not valid{' in sanity mode' if sanity else ''}",
                "use expand >= 1 (expand: 1 with sanity: true)",
            )
        if rope not in ("none", "before"):
            raise ConfigError(
                f"mamba option rope={rope!r} is not valid",
                "use rope: none (default, as Mamba in the Llama) or before",
            )
        self.d_state, self.expand, self.sanity = d_state, expand, sanity
        self.use_rope, self.chunk_size = rope == "before", chunk_size
        self.scaling = geometry.get("scaling", d**-0.5)
        self.d_inner = self.num_heads * d
        self.groups = self.d_inner // d_state  # value channels per group = d_state
        self.conv_activation = check_activation(conv_activation)
        self.dt_range = (dt_min, dt_max)
        if sanity:
            d_conv, gate, D = 0, False, False
        self.conv = CausalConv(self.d_inner, d_conv) if d_conv else None  # after the GQA repeat, as released
        self.gate = nn.Linear(self.hidden_size, self.d_inner, bias=True) if gate else None
        self.D = nn.Parameter(torch.ones(self.d_inner)) if D else None
        if not sanity:
            self.dt_rank = dt_rank or math.ceil(self.hidden_size / 16)
            self.dt_down = nn.Linear(self.hidden_size, self.dt_rank, bias=False)
            self.dt_up = nn.Linear(self.dt_rank, expand * self.d_inner, bias=True)
            # (copies·groups, p, n)
            self.A_log = nn.Parameter(torch.empty(expand * self.groups, d_state, d_state))
        self.init_new_parameters()

    @torch.no_grad()
    def init_new_parameters(self) -> None:
        """(Re)initialise everything attention does not provide; q/k/v/o are left alone."""
        init_shared_parameters(self)
        if not self.sanity:
            nn.init.kaiming_uniform_(self.dt_down.weight, a=math.sqrt(5))
            bound = self.dt_rank**-0.5
            self.dt_up.weight.uniform_(-bound, bound)
            self.dt_up.bias.copy_(dt_bias_init(self.expand * self.d_inner, *self.dt_range))
            if self.A_log_init is not None:  # A ≈ 0: no decay at the start (as CAB)
                self.A_log.fill_(self.A_log_init)
            else:  # S4D-real: A = −(1, 2, …, N) along the state for every channel.
                self.A_log.copy_(
                    torch.log(torch.arange(1, self.d_state + 1, dtype=torch.float32)).expand_as(self.A_log)
                )

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """(b, l, h·d) → (b, l, copies·groups, d_state), the copies stacked along the group dim."""
        b, l, _ = t.shape
        t = t.reshape(b, l, self.groups, self.d_state)
        return t.repeat(1, 1, self.expand, 1) if self.expand > 1 else t

    def _scan_inputs(self, u, x, inputs=None):
        """x (b, l, d_inner) after the conv → (x, Δ, A) in the scan's (b, l, G, p) layout."""
        b, l, _ = u.shape
        xg = self._groups(x)
        if self.sanity:
            return xg, torch.ones_like(xg), xg.new_zeros(self.groups, self.d_state, self.d_state)
        low = self.dt_down(u) if inputs is None else inputs["dt_down"]
        dt = F.softplus(self.dt_up(low).float()).to(x.dtype)
        dt = dt.reshape(b, l, self.expand * self.groups, self.d_state)
        return xg, dt, -torch.exp(self.A_log.float()).to(x.dtype)

    def _bc(self, u, position_embeddings, inputs=None):
        """u → x (b, l, d_inner) before the conv, B and C (b, l, G, d_state)."""
        q, k, v = self.project_heads(u, position_embeddings if self.use_rope else None, inputs)
        C = q * self.scaling
        self.bc_tap(k, C)  # per-token B (b, l, kv, d) before the GQA repeat and C (b, l, h, d)
        x = self.repeat_kv(v, 2).flatten(2)  # (b, l, d_inner)
        return x, self._groups(self.repeat_kv(k, 2).flatten(2)), self._groups(C.flatten(2))

    def _output(self, y, x, u, inputs=None):
        b, l = y.shape[:2]
        y = y.reshape(b, l, self.expand, self.d_inner).sum(2)
        if self.D is not None:
            y = y + self.D.to(y.dtype) * x
        if self.gate is not None:
            y = y * F.silu(self.gate(u) if inputs is None else inputs["gate"])
        return self.o_proj(y)

    def step(self, u, position_embeddings, states: dict, mask=None, seen: int | None = None):
        """One token against the carried states (see ``AttentionLikeMixer``), the recurrence of the
        module docstring: (output, {"ssm": h_t, "conv": its window})."""
        new = {}
        inputs = self.project_inputs(u)
        x, B, C = self._bc(u, position_embeddings, inputs)
        x, conv_state, m = conv_step(self.conv, x, states, mask, self.conv_activation)
        if conv_state is not None:
            new["conv"] = conv_state
        xg, dt, A = self._scan_inputs(u, x, inputs)
        if m is not None:  # and leaves the state alone: Δ = 0 (decay 1, no input)
            dt = dt * m[..., None].to(dt.dtype)
        y, new["ssm"] = selective_scan_step(xg[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], states["ssm"])
        return self._output(y[:, None], x, u, inputs), new

    def mix(self, hidden_states, position_embeddings, layer):
        b, l, _ = hidden_states.shape
        states = {} if layer is None else layer.states
        mask = self.padding_mask(l)
        inputs = self.project_inputs(hidden_states)
        x, B, C = self._bc(hidden_states, position_embeddings, inputs)
        x, conv_state = apply_conv(self.conv, x, states, mask, self.conv_activation, self.context.kernels)
        xg, dt, A = self._scan_inputs(hidden_states, x, inputs)
        y, ssm = selective_scan_chunked(
            xg,
            dt,
            A,
            B,
            C,
            mask=mask,
            state=states.get("ssm"),
            chunk_size=self.chunk_size,
            backend=self.context.kernels,
        )
        store_states(layer, ssm, conv_state, l)
        return self._output(y, x, hidden_states, inputs)
