"""HedgeMamba (Attention-to-Mamba, Eqs. 8–10, App. B): Hedgehog linear attention inside a Mamba block.

B ← φ_k(W_K u), C ← φ_q(W_Q u), SSM input ← W_V u, plus Mamba's extras — a learned decay Λ,
a causal depthwise conv and a SiLU output gate — each initialised to the identity, so at init
the mixer computes exactly the normalised Hedgehog linear attention of a ``LinearAttentionMixer``
with the same weights. The teacher's projections keep their names (``q_proj``, ``k_proj``,
``v_proj``, ``o_proj``) and the maps those of ``LinearAttentionMixer`` (``feature_map_q``,
``feature_map_k``), so a Stage-1 Hedgehog state dict loads by name (``load_linear_attention``).

Per token, with u the layer input (after the block's norm):
    g = SiLU(W_g u + b_g)                               (from the pre-conv input, as Lst. 2)
    x = conv(u)                                         (depthwise causal over the hidden channels,
                                                         no activation: φ supplies the non-linearity)
    q, k, v = W_Q x, W_K x, W_V x   (RoPE before φ),    C = φ_q(q), B = φ_k(k)   (GQA: k, v repeated)
    Δ = softplus(W_Δ x + b_Δ)  (one per head),  a = Δ·min(A, 0) ≤ 0
    S_t = exp(a_t)·S_{t−1} + Δ_t [v_t; 1] ⊗ B_t,   [n_t; z_t] = S_t C_t
    y_t = n_t / (z_t + eps),   out = W_O (y ⊙ g)

The ``[v; 1]`` channel is Eq. 10's one-pass normalisation: the denominator Σ_s w_ts with the
same decay and Δ as the numerator. The decay is one scalar per head and token (Mamba-2 / SSD, so
``ops.ssd`` runs all three forms), hence a single ones-channel per head suffices — the paper's
per-value-channel copies of it would all be equal. State per head: (head_dim + 1) × f.

Identity init (``init_new_parameters``) and the choices behind it:
  * decay: a raw per-head ``A`` (the paper's ``self.A``, not −exp(A_log), which cannot reach 0),
    initialised to ``A_init`` (default 0 ⇒ Λ = exp(0) = 1 exactly). The scan ops need a ≤ 0, so
    the forward uses min(A, 0); its gradient passes *straight through* (as if unclamped), so A
    still trains from exactly 0 and a head whose A drifted above 0 can come back — a plain clamp
    would freeze it there for good.
  * Δ: zero weight, bias softplus⁻¹(1) = ln(e − 1) ⇒ Δ ≡ 1 (Δ scales the input, Eq. 11).
  * conv: last tap 1, other taps and bias 0 (``CausalConv``); gate: zero weight, bias SiLU⁻¹(1).
All of them get non-zero gradients at init, so Stage 2 moves them off the identity.

Where the paper is ambiguous the choice is an option:
  * ``rope``: ``before_map`` (default; as ``LinearAttentionMixer``, Hedgehog, LoLCATs — needed for
    the exact match with a Stage-1 linear-attention student), ``after_map`` (the paper's Lst. 2:
    rotate the first ``rotary_dim`` *features*; the kernel can then turn negative and the
    denominator with it), ``none``.
  * ``decay`` / ``d_conv`` / ``gate``: switch the extras off for the paper's Tab. 2 ablation
    (Hedgehog → +SSM → +Conv → +Gate); with all three off this is Hedgehog linear attention.
  * ``feature_map`` (default ``hedgehog``) and its options: any map of ``feature_maps.py``.
Deviations from Lst. 2 (documented, not options): Δ and A are per head, not per value channel;
Δ is a full-rank Linear(hidden → heads) rather than Mamba's low-rank dt path; no D skip (it
would break the identity init). On CUDA with ``mamba_ssm``, ``ssd_chunked`` maps a log-decay of
exactly 0 to −1e-6 per token (see ``ops/ssd.py``), so there the init equals Hedgehog to ~1e-6·l.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.base import AttentionLikeMixer
from attn2ssm.mixers.feature_maps import build_feature_map
from attn2ssm.mixers.options import NonNegativeInt, PositiveFloat, PositiveInt
from attn2ssm.mixers.ssm_common import (
    CausalConv,
    ConvRecurrence,
    apply_conv,
    init_shared_parameters,
    store_states,
)
from attn2ssm.ops.conv import causal_conv1d, causal_conv1d_step
from attn2ssm.ops.rope import apply_rotary
from attn2ssm.ops.ssd import ssd_chunked, ssd_quadratic, ssd_step

# softplus(b) = 1 at b = ln(e − 1) ≈ 0.541324: a zero-weight Δ projection with this bias gives Δ ≡ 1.
DT_IDENTITY_BIAS = math.log(math.e - 1.0)

ROPE_PLACEMENTS = ("before_map", "after_map", "none")


class HedgeMambaMixer(ConvRecurrence, AttentionLikeMixer):
    mixer_type = "hedgemamba"
    # q/k/v and Δ read the conv output; the gate reads the layer input, so it is not one of them
    input_linears = ("q_proj", "k_proj", "v_proj", "dt_proj")
    # forward_quadratic's matrix is normalised attention (rows sum to 1), like linear attention's
    normalized_weights = True

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        feature_map: str = "hedgehog",
        feature_map_options: dict | None = None,
        rope: str = "before_map",
        decay: bool = True,
        A_init: float = 0.0,
        d_conv: NonNegativeInt = 4,
        gate: bool = True,
        chunk_size: PositiveInt = 64,
        eps: PositiveFloat = 1e-6,
    ):
        super().__init__(geometry, layer_idx)
        if rope not in ROPE_PLACEMENTS:
            raise ConfigError(
                f"hedgemamba option rope={rope!r} is not valid", f"use one of: {', '.join(ROPE_PLACEMENTS)}"
            )
        if not A_init <= 0.0:
            raise ConfigError(
                f"hedgemamba option A_init={A_init} is positive",
                "use A_init <= 0 (0 = no decay, the identity init)",
            )
        opts = feature_map_options or {}
        self.feature_map_q = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.feature_map_k = build_feature_map(feature_map, self.num_heads, self.head_dim, **opts)
        self.rope, self.A_init, self.chunk_size, self.eps = rope, float(A_init), chunk_size, eps
        h = self.num_heads
        # the conv runs over the layer input (hidden channels), before q/k/v, as Lst. 2
        self.conv = CausalConv(self.hidden_size, d_conv) if d_conv else None
        self.gate = nn.Linear(self.hidden_size, h * self.head_dim, bias=True) if gate else None
        self.dt_proj = nn.Linear(self.hidden_size, h, bias=True) if decay else None
        self.A = nn.Parameter(torch.empty(h)) if decay else None
        self.init_new_parameters()

    @torch.no_grad()
    def init_new_parameters(self) -> None:
        """(Re)set the Mamba extras to the identity; q/k/v/o and the feature maps are left alone."""
        init_shared_parameters(self)  # conv passes the token, gate ≡ 1
        if self.dt_proj is not None:
            self.dt_proj.weight.zero_()
            self.dt_proj.bias.fill_(DT_IDENTITY_BIAS)
            self.A.fill_(self.A_init)

    @torch.no_grad()
    def load_linear_attention(self, source) -> None:
        """Load a trained ``LinearAttentionMixer`` (module or state dict) into this mixer: every
        one of its tensors must land here (q/k/v/o, norms, feature maps); only the Mamba extras
        keep their own values. Raises ValueError naming what does not transfer."""
        state = source.state_dict() if isinstance(source, nn.Module) else source
        result = self.load_state_dict(state, strict=False)
        extras = ("conv.", "gate.", "dt_proj.", "A")
        missing = [k for k in result.missing_keys if not k.startswith(extras)]
        if result.unexpected_keys or missing:
            raise ValueError(
                f"linear-attention weights do not fit this hedgemamba mixer: unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}"
            )

    # -- the pieces ------------------------------------------------------------------------
    def _features(self, x, position_embeddings, offset: int | None, inputs=None):
        """Conv output x (b, l, hidden) → C = φq, B = φk (b, l, h, f) and v (b, l, h, d), GQA
        repeated. ``offset``: the first token's position (None: unknown, for maps that read none)."""
        q, k, v = self.project_qkv(x, position_embeddings if self.rope == "before_map" else None, inputs)
        maps = (self.feature_map_q, self.feature_map_k)
        if offset is None and any(getattr(m, "uses_positions", False) for m in maps):
            raise ValueError(
                f"{type(self.feature_map_q).__name__} needs the token's position: pass step(..., seen=)"
            )
        positions = None if offset is None else torch.arange(offset, offset + x.shape[1], device=x.device)
        fq, fk = self.feature_map_q(q, positions), self.feature_map_k(k, positions)  # (b, h, l, f)
        if self.rope == "after_map" and position_embeddings is not None and self.rotary_dim:
            cos, sin = position_embeddings
            fq, fk = apply_rotary(fq, cos, sin, self.rotary_dim), apply_rotary(fk, cos, sin, self.rotary_dim)
        return fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2)

    def _scan_inputs(self, x, v, inputs=None):
        """(log-decay a (b, l, h) ≤ 0, scan input Δ·[v; 1] (b, l, h, d + 1) in float32, Δ or None)."""
        b, l, h, _ = v.shape
        ones = v.new_ones(b, l, h, 1, dtype=torch.float32)
        xv = torch.cat([v.float(), ones], dim=-1)  # Eq. 10: the ones channel carries the denominator
        if self.dt_proj is None:
            return xv.new_zeros(b, l, h), xv, None
        dt = F.softplus((self.dt_proj(x) if inputs is None else inputs["dt_proj"]).float())  # (b, l, h)
        A = self.A.float()
        A = A - A.detach().clamp_min(0.0)  # forward min(A, 0), straight-through gradient
        return dt * A, xv * dt[..., None], dt

    def _output(self, y, u):
        """Scan output y (b, l, h, d + 1) → o_proj(normalised y ⊙ gate)."""
        y = y[..., :-1] / (y[..., -1:] + self.eps)  # Eq. 9, same eps convention as linear attention
        y = y.to(u.dtype).flatten(2)
        if self.gate is not None:
            y = y * F.silu(self.gate(u))
        return self.o_proj(y)

    # -- forward forms ---------------------------------------------------------------------
    def features(self, hidden_states, position_embeddings=None, offset: int = 0):
        """(φq, φk, v), each (b, h, l, ·), for a sequence starting from an empty conv state —
        the same quantities ``LinearAttentionMixer.features`` exposes."""
        x = hidden_states
        if self.conv is not None:
            x, _ = causal_conv1d(x, self.conv.weight, self.conv.bias)
        fq, fk, v = self._features(x, position_embeddings, offset)
        return fq.transpose(1, 2), fk.transpose(1, 2), v.transpose(1, 2)

    def attention_weights(self, hidden_states, position_embeddings=None, mask=None):
        """The materialised (b, h, l, l) normalised mixing matrix for this input."""
        return self.forward_quadratic(hidden_states, position_embeddings, mask)[1]

    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), weights (b, h, l, l)) through the materialised form: weights
        W[t, s] = Δ_s·exp(a_{s+1} + … + a_t)·(C_t·B_s) / (Σ_s' … + eps), out = o_proj((W v) ⊙ g).
        Rows sum to ~1 (0 at padding), as ``LinearAttentionMixer.forward_quadratic``. No cache."""
        x = hidden_states
        if self.conv is not None:
            x, _ = causal_conv1d(x, self.conv.weight, self.conv.bias, mask=mask)
        C, B, v = self._features(x, position_embeddings, 0)
        a, xv, dt = self._scan_inputs(x, v)
        y, M = ssd_quadratic(xv, a, B, C, mask=mask, return_matrix=True)  # M excludes Δ_s
        if dt is not None:  # fold Δ_s into the matrix: y = M [v; 1]
            M = M * dt.transpose(1, 2)[:, :, None, :]
        weights = M / (y[..., -1].transpose(1, 2)[..., None] + self.eps)  # row sums = denominators
        return self._output(y, hidden_states), weights

    def step(self, u, position_embeddings, states: dict, mask=None, seen: int | None = None):
        """One token against the carried states (see ``AttentionLikeMixer``), the recurrence of the
        module docstring: (output, {"ssm": S_t, "conv": its window})."""
        new = {}
        m = None if mask is None else mask.to(torch.float32).view(-1, 1, 1)
        # a padded token enters the conv window as 0 (as the chunked form)
        x = u if m is None else u * m.to(u.dtype)
        if self.conv is not None:
            x, new["conv"] = causal_conv1d_step(x[:, 0], self.conv.weight, self.conv.bias, states["conv"])
            x = x[:, None]
        inputs = self.project_inputs(x)
        C, B, v = self._features(x, position_embeddings, seen, inputs)
        a, xv, _ = self._scan_inputs(x, v, inputs)
        if m is not None:  # and leaves the state alone: decay 1, no input
            a, xv = a * m, xv * m[..., None]
        y, new["ssm"] = ssd_step(xv[:, 0], a[:, 0], B[:, 0].float(), C[:, 0].float(), states["ssm"])
        return self._output(y[:, None], u), new

    def mix(self, hidden_states, position_embeddings, layer):
        b, l, _ = hidden_states.shape
        states = {} if layer is None else layer.states
        mask = self.padding_mask(l)
        x, conv_state = apply_conv(self.conv, hidden_states, states, mask, None, self.context.kernels)
        inputs = self.project_inputs(x)
        C, B, v = self._features(x, position_embeddings, 0 if layer is None else layer.seen, inputs)
        a, xv, _ = self._scan_inputs(x, v, inputs)
        y, ssm = ssd_chunked(
            xv,
            a,
            B,
            C,
            mask=mask,
            state=states.get("ssm"),
            chunk_size=self.chunk_size,
            backend=self.context.kernels,
        )
        store_states(layer, ssm, conv_state, l)
        return self._output(y, hidden_states)
