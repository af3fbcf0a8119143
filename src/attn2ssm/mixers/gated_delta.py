"""Gated DeltaNet (the gated delta rule) as a drop-in for a teacher attention module, initialised from it.

The recurrence (ops/gated_delta.py), per head with L2-normalised q_t, k_t:

    S_t = S_{t-1} α_t (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    o_t = S_t q_t / √d

A decaying outer-product state (linear attention, Mamba-2) can only add to what a key holds; the
delta rule moves the value stored under k_t a step β_t towards v_t, so a key can be re-bound —
the reason gated delta-rule mixers keep associative recall where the others lose it, and the mixer
of the 2026 distillation results and of the pretrained hybrids (Qwen3-Next, Qwen3.5, OLMo-Hybrid).

Layer (Qwen3-Next's Gated DeltaNet layer, fed the teacher's projections):

    q, k, v = W_Q u, W_K u, W_V u                 (the teacher's; k, v per KV head, q per query head)
    q, k, v = SiLU(conv([q, k, v]))                (depthwise causal, passes the token at init)
    k, v repeated over each query group (GQA); q, k L2-normalised per head
    α_t = exp(g_t),  g_t = −exp(A_log) · softplus(W_a u_t + dt_bias)   (one decay per head and token)
    β_t = sigmoid(W_b u_t + b_b)                                        (one write strength per head)
    out = W_O · (RMSNorm_head(o) · w ⊙ SiLU(W_z u))                     (output gate and norm optional)

Initialisation: q/k/v/o from the teacher; W_a, W_b zero, so every head starts with a constant
decay and write strength set from ``alpha_init`` / ``beta_init`` — or, with ``decay_init:
calibrated`` (the default), per head from the teacher's measured attention locality and key
statistics on calibration blocks (``distill/calibration.py`` sets them when a run builds its
student; a student built without calibration keeps the constant ones). The gate starts at the
identity (zero weight, bias with SiLU(b) = 1) and the norm's weight at 1.

Three biases Qwen3.5's Gated DeltaNet layer (``Qwen3_5ForCausalLM``, llama.cpp's ``qwen35``, where
``export --format native`` / ``gguf`` write a pure student: export/native_qwen35.py) does not have;
each can be turned off so that a student exports exactly:

* ``conv_bias: false`` — the conv without bias (it starts at 0 anyway: no change at init);
* ``beta_bias: false`` — β = sigmoid(W_b u) without b_b: every head starts at β = 1/2 and a
  calibration sets the decays only (the per-head β it measures has no place: the layer's input is
  RMS-normalised, with no constant direction a zero-bias W_b could read);
* ``gate_bias: false`` — the gate without bias: SiLU(0) = 0 would silence the mixer, so W_z starts at
  nn.Linear's random init (as Mamba-2's ``gate_bias: false``): the student no longer starts as the
  plain delta-rule read-out of the teacher's projections; ``gate: false`` does not export (the
  target always gates).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.options import NonNegativeInt, PositiveInt
from attn2ssm.mixers.ssm_common import (
    CausalConv,
    ConvRecurrence,
    apply_conv,
    check_activation,
    check_norm_eps,
    conv_step,
    init_identity_gate,
    store_states,
)
from attn2ssm.ops.conv import causal_conv1d_state
from attn2ssm.ops.gated_delta import gated_delta_chunked, gated_delta_quadratic, gated_delta_step

DECAY_INITS = ("calibrated", "plain")


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (y > 0)."""
    return y + torch.log(-torch.expm1(-y))


class HeadRMSNormGated(nn.Module):
    """Per-head RMSNorm of the output, then the SiLU gate (Qwen3-Next's order): norm(o) · w ⊙ SiLU(z)."""

    def __init__(self, num_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.weight = nn.Parameter(torch.ones(head_dim))

    def forward(self, o: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """o (b, l, h, d), z (b, l, h·d) or None → (b, l, h·d)."""
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        of = of.flatten(2)
        if z is not None:
            of = of * F.silu(z.float())
        return of.to(o.dtype)


class GatedDeltaMixer(ConvRecurrence, AttentionLikeMixer):
    mixer_type = "gated_delta"
    input_linears = ("q_proj", "k_proj", "v_proj", "gate", "a_proj", "b_proj")

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        d_conv: NonNegativeInt = 4,
        conv_activation: str | None = "silu",
        gate: bool = True,
        norm: bool = True,
        norm_eps: float = 1e-6,
        decay_init: str = "calibrated",
        alpha_init: float = 0.99,
        beta_init: float = 0.5,
        rope: str = "none",
        chunk_size: PositiveInt = 64,
        gate_bias: bool = True,
        conv_bias: bool = True,
        beta_bias: bool = True,
    ):
        super().__init__(geometry, layer_idx)
        if decay_init not in DECAY_INITS:
            raise ConfigError(
                f"gated_delta option decay_init={decay_init!r} is not valid",
                f"use one of: {', '.join(DECAY_INITS)}",
            )
        for name, value in (("alpha_init", alpha_init), ("beta_init", beta_init)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
                raise ConfigError(
                    f"gated_delta option {name}={value!r} is not in (0, 1)", f"use e.g. {name}: 0.5"
                )
        if rope not in ("none", "before"):
            raise ConfigError(
                f"gated_delta option rope={rope!r} is not valid", "use rope: none (default) or before"
            )
        if not beta_bias and beta_init != 0.5:
            raise ConfigError(
                f"gated_delta option beta_init={beta_init!r} needs b_proj's bias, and beta_bias is false (every head starts at β = 1/2)",
                "leave beta_init out (0.5), or set beta_bias: true",
            )
        self.decay_init, self.alpha_init, self.beta_init = decay_init, float(alpha_init), float(beta_init)
        self.use_rope, self.chunk_size = rope == "before", chunk_size
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.conv_activation = check_activation(conv_activation)
        # over [q, k, v] before the GQA repeat
        self.conv = CausalConv((h + 2 * kv) * d, d_conv, bias=bool(conv_bias)) if d_conv else None
        self.a_proj = nn.Linear(self.hidden_size, h, bias=False)
        self.b_proj = nn.Linear(self.hidden_size, h, bias=bool(beta_bias))
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log = nn.Parameter(torch.empty(h))
        self.gate = nn.Linear(self.hidden_size, h * d, bias=bool(gate_bias)) if gate else None
        self.norm = HeadRMSNormGated(h, d, check_norm_eps(self.mixer_type, norm_eps)) if norm else None
        self.init_new_parameters()

    # -- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def init_new_parameters(self) -> None:
        """(Re)initialise everything attention does not provide; q/k/v/o are left alone."""
        if self.conv is not None:
            self.conv.reset_parameters()
        if self.gate is not None and self.gate.bias is not None:
            init_identity_gate(self.gate)
        elif self.gate is not None:  # no bias: SiLU(0) = 0 would silence the mixer (module docstring)
            self.gate.reset_parameters()
        if self.norm is not None:
            self.norm.weight.fill_(1.0)
        self.a_proj.weight.zero_()
        self.b_proj.weight.zero_()
        self.A_log.zero_()  # A = 1: the decay is exp(−softplus(·)), set by dt_bias
        self.set_head_decays(
            torch.full((self.num_heads,), self.alpha_init), torch.full((self.num_heads,), self.beta_init)
        )

    @torch.no_grad()
    def set_head_decays(self, alpha: torch.Tensor, beta: torch.Tensor) -> None:
        """Start head h at decay α_h and write strength β_h (with W_a, W_b at zero): what a
        calibration measured, or the constants of ``alpha_init`` / ``beta_init``. Without b_proj's
        bias (``beta_bias: false``) β stays 1/2 and only the decays are set."""
        alpha = alpha.to(self.dt_bias.device).float().clamp(1e-4, 1 - 1e-6)  # measured where the teacher is
        self.dt_bias.copy_(inverse_softplus(-torch.log(alpha) / torch.exp(self.A_log.float())))
        if self.b_proj.bias is not None:
            self.b_proj.bias.copy_(
                torch.logit(beta.to(self.b_proj.bias.device).float().clamp(1e-4, 1 - 1e-4))
            )

    # -- the pieces ------------------------------------------------------------------------
    def _qkv(self, u, position_embeddings, inputs=None):
        """Projected (b, l, c) channels [q, k, v] before the conv (k, v at the KV heads' width)."""
        q, k, v = self.project_heads(u, position_embeddings if self.use_rope else None, inputs)
        return torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)

    def _split(self, qkv):
        """(b, l, c) → q, k (b, l, h, d) L2-normalised, v (b, l, h, d), k and v repeated over each group."""
        b, l, _ = qkv.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
        k = self.repeat_kv(k.reshape(b, l, kv, d), 2)
        v = self.repeat_kv(v.reshape(b, l, kv, d), 2)
        return F.normalize(q.reshape(b, l, h, d).float(), dim=-1), F.normalize(k.float(), dim=-1), v

    def _gates(self, u, inputs=None):
        """(log-decay g (b, l, h) ≤ 0, write strength β (b, l, h)), float32."""
        a = (self.a_proj(u) if inputs is None else inputs["a_proj"]).float()
        b = (self.b_proj(u) if inputs is None else inputs["b_proj"]).float()
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())
        return g, torch.sigmoid(b)

    def _output(self, o, u, inputs=None):
        """o (b, l, h, d) → o_proj(norm/gate(o))."""
        z = None if self.gate is None else (self.gate(u) if inputs is None else inputs["gate"])
        if self.norm is not None:
            y = self.norm(o, z)
        else:
            y = o.flatten(2)
            if z is not None:
                y = y * F.silu(z.float()).to(y.dtype)
        return self.o_proj(y.to(self.o_proj.weight.dtype))

    def _conv(self, qkv, states, mask):
        if self.conv is None:
            return qkv, None
        return apply_conv(self.conv, qkv, states, mask, self.conv_activation, self.context.kernels)

    # -- forward forms ---------------------------------------------------------------------
    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), the materialised map M (b, h, l, l) from v to o) — for layer-local
        losses and plots; no cache."""
        qkv, _ = self._conv(self._qkv(hidden_states, position_embeddings), {}, mask)
        q, k, v = self._split(qkv)
        g, beta = self._gates(hidden_states)
        o, _, M = gated_delta_quadratic(q, k, v, g, beta, mask, return_matrix=True)
        return self._output(o, hidden_states), M

    def step(self, u, position_embeddings, states: dict, mask=None, seen: int | None = None):
        """One token against the carried states (see ``AttentionLikeMixer``): (output, {"ssm", "conv"})."""
        new = {}
        inputs = self.project_inputs(u)
        qkv = self._qkv(u, position_embeddings, inputs)  # (b, 1, c)
        qkv, conv_state, m = conv_step(self.conv, qkv, states, mask, self.conv_activation)
        if conv_state is not None:
            new["conv"] = conv_state
        q, k, v = self._split(qkv)
        g, beta = self._gates(u, inputs)
        if m is not None:  # and leaves the state alone: decay 1, no write
            g, beta = g * m, beta * m
        o, new["ssm"] = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states["ssm"])
        return self._output(o[:, None], u, inputs), new

    def mix(self, hidden_states, position_embeddings, layer):
        b, l, _ = hidden_states.shape
        states = {} if layer is None else layer.states
        mask = self.padding_mask(l)
        inputs = self.project_inputs(hidden_states)
        pre_conv = self._qkv(hidden_states, position_embeddings, inputs)
        qkv, conv_state = self._conv(pre_conv, states, mask)
        q, k, v = self._split(qkv)
        g, beta = self._gates(hidden_states, inputs)
        o, ssm = gated_delta_chunked(
            q,
            k,
            v,
            g,
            beta,
            mask,
            states.get("ssm"),
            chunk_size=self.chunk_size,
            backend=self.context.kernels,
        )
        if layer is not None and layer.record_past:  # a speculative verify: say how to stop after any prefix
            layer.set_rollback(
                lambda start, keep: self._states_after(start, keep, pre_conv, q, k, v, g, beta, mask)
            )
        store_states(layer, ssm, conv_state, l)
        return self._output(o, hidden_states, inputs)

    def _states_after(self, start: dict, keep: int, pre_conv, q, k, v, g, beta, mask) -> dict:
        """The states after the first ``keep`` tokens of a forward that began at ``start``, from the
        q, k, v, g, β it computed (a speculative rollback: no projection is run again)."""
        m = None if mask is None else mask[:, :keep]
        new = dict(start)
        _, new["ssm"] = gated_delta_chunked(
            q[:, :keep],
            k[:, :keep],
            v[:, :keep],
            g[:, :keep],
            beta[:, :keep],
            m,
            start.get("ssm"),
            chunk_size=self.chunk_size,
        )
        if self.conv is not None:
            new["conv"] = causal_conv1d_state(
                pre_conv[:, :keep], self.conv.kernel, state=start.get("conv"), mask=m
            )
        return new
