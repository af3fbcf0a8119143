"""Mamba-2 (SSD) as a drop-in for a teacher attention module, initialised from it ("Mamba in the
Llama").

Attention → SSM weight mapping (Mamba in the Llama, Fig. 1): C ← W_Q, B ← W_K, x ← W_V, out ← W_O, kept
under the teacher's names (``q_proj`` = C, ``k_proj`` = B, ``v_proj`` = x, ``o_proj`` = out) so
LoRA targets and weight surgery read the same as for attention. C is also scaled by the
teacher's 1/√d, so C·B is the teacher's attention logit. GQA: x and B keep the kv width and are
repeated over each query group after the conv; C keeps the query width. One SSD head per query
head with state (head_dim × head_dim) — the size of a linear-attention KV state. No RoPE by
default (Mamba in the Llama's mixers drop it; ``rope: before`` keeps it on B and C).

Per token, with u the layer input (after the block's norm):
    x, B, C = conv([W_V u, W_K u, W_Q u / √d])          (depthwise causal, passes the token at init)
    Δ = softplus(W_Δ u + b_Δ)  (one per head),  a = Δ·A,  A = −exp(A_log)   (A_init: A ≈ 0, as CAB)
    h_t = exp(a_t)·h_{t−1} + (Δ_t x_t) ⊗ B_t,   y_t = h_t C_t + D ⊙ x_t
    out = W_O · norm(y ⊙ SiLU(W_z u + b_z))            (gated RMSNorm per head, optional)

``norm_eps`` is the gated norm's ε (1e-6 by default, as students were always built). Native
hybrid classes (GraniteMoeHybrid, Bamba) use the config's one ``rms_norm_eps`` for it and for
every block norm, so a student meant for ``attn2ssm export --format native`` trains with the
teacher's ``rms_norm_eps`` here: ``norm_eps: auto``, resolved to that number when the student is
built (student/convert.py; student/native_export.py says so when they differ).

``gate_bias: false`` drops the gate's bias, as mamba_ssm's in_proj has none. llama.cpp's Mamba-2
layer has no in_proj bias, so only such students export exactly to GGUF (student/gguf_export.py).
Without a bias the gate cannot start at the identity (SiLU(0·u) = 0 would silence the mixer): its
weight starts as ``nn.Linear``'s default (Kaiming-uniform), as mamba_ssm's does.

MOHAWK's Phi-Mamba mixer, ``DiscreteMamba2Mixer`` (discrete_mamba2.py), is this mixer with the
decay read from the input instead of Δ and A.

``sanity=True`` turns every addition off (Δ = 1, A = 0, no conv / gate / D / norm) and the
mixer computes linearised attention exactly: y_t = Σ_{s≤t} (q_t·k_s/√d) v_s (Mamba in the Llama §1.3).
"""

from __future__ import annotations

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
    GatedRMSNorm,
    apply_conv,
    check_activation,
    check_norm_eps,
    conv_step,
    dt_bias_init,
    init_shared_parameters,
    store_states,
)
from attn2ssm.mixers.taps import Tap
from attn2ssm.ops.conv import causal_conv1d, causal_conv1d_state
from attn2ssm.ops.ssd import ssd_chunked, ssd_quadratic, ssd_state, ssd_step


class Mamba2Mixer(ConvRecurrence, AttentionLikeMixer):
    mixer_type = "mamba2"
    input_linears = ("q_proj", "k_proj", "v_proj", "gate", "dt_proj")

    def __init__(
        self,
        geometry: dict,
        layer_idx: int,
        d_conv: NonNegativeInt = 4,
        conv_activation: str | None = "silu",
        gate: bool = True,
        gate_bias: bool = True,
        norm: bool = False,
        norm_eps: float = 1e-6,
        D: bool = True,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        dt_min: PositiveFloat = 1e-3,
        dt_max: PositiveFloat = 0.1,
        a_init_range: tuple[float, float] = (-8.0, -7.0),
        rope: str = "none",
        chunk_size: PositiveInt = 64,
        sanity: bool = False,
        D_init: float = 0.0,
        A_init: float | None = None,
    ):
        super().__init__(geometry, layer_idx)
        self.D_init = D_init
        self.A_log_init = A_log_identity(self.mixer_type, A_init)  # None: A drawn from A_init_range
        self.bc_tap = Tap()  # shows B and C, as the scan reads them, to a stage that hooks it (CAB)
        if rope not in ("none", "before"):
            raise ConfigError(
                f"{self.mixer_type} option rope={rope!r} is not valid",
                "use rope: none (default, as Mamba in the Llama) or before",
            )
        self.use_rope, self.chunk_size, self.sanity = rope == "before", chunk_size, sanity
        self.scaling = geometry.get("scaling", self.head_dim**-0.5)
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.conv_activation = check_activation(conv_activation)
        self.dt_range, self.A_init_range, self.a_init_range = (
            (dt_min, dt_max),
            tuple(A_init_range),
            tuple(a_init_range),
        )
        if sanity:
            d_conv, gate, norm, D = 0, False, False, False
        # conv over [x (kv·d), B (kv·d), C (h·d)] before the GQA repeat, as Mamba in the Llama's Mamba-2.
        self.conv = CausalConv((2 * kv + h) * d, d_conv) if d_conv else None
        self.gate = nn.Linear(self.hidden_size, h * d, bias=bool(gate_bias)) if gate else None
        self.norm = GatedRMSNorm(h, d, check_norm_eps(self.mixer_type, norm_eps)) if norm else None
        self.D = nn.Parameter(torch.ones(h)) if D else None
        self.make_decay_parameters(sanity)
        self.init_new_parameters()

    def make_decay_parameters(self, sanity: bool) -> None:
        """Δ's projection and A (none in sanity mode: Δ = 1, A = 0)."""
        self.dt_proj = None if sanity else nn.Linear(self.hidden_size, self.num_heads, bias=True)
        self.A_log = None if sanity else nn.Parameter(torch.empty(self.num_heads))

    @torch.no_grad()
    def init_new_parameters(self) -> None:
        """(Re)initialise everything attention does not provide; q/k/v/o are left alone."""
        init_shared_parameters(self)
        self.init_decay_parameters()

    @torch.no_grad()
    def init_decay_parameters(self) -> None:
        if self.dt_proj is None:
            return
        h = self.num_heads
        bound = self.hidden_size**-0.5
        self.dt_proj.weight.uniform_(-bound, bound)
        self.dt_proj.bias.copy_(dt_bias_init(h, *self.dt_range))
        if self.A_log_init is not None:  # A ≈ 0: every head starts without decay (as CAB)
            self.A_log.fill_(self.A_log_init)
        else:
            lo, hi = self.A_init_range
            self.A_log.copy_(torch.log(torch.rand(h) * (hi - lo) + lo))

    # -- the pieces ------------------------------------------------------------------------
    def _xbc(self, u, position_embeddings, inputs=None):
        """Projected (b, l, c) channels [x, B, C] before the conv."""
        q, k, v = self.project_heads(u, position_embeddings if self.use_rope else None, inputs)
        return torch.cat([v.flatten(2), k.flatten(2), (q * self.scaling).flatten(2)], dim=-1)

    def _split(self, xbc):
        """(b, l, c) → x (b, l, h, p), B (b, l, h, n), C (b, l, h, n) with kv heads repeated."""
        b, l, _ = xbc.shape
        kvw, d = self.num_kv_heads * self.head_dim, self.head_dim
        x, B, C = xbc.split([kvw, kvw, self.num_heads * d], dim=-1)
        x = self.repeat_kv(x.reshape(b, l, self.num_kv_heads, d), 2)
        B = self.repeat_kv(B.reshape(b, l, self.num_kv_heads, d), 2)
        return x, B, C.reshape(b, l, self.num_heads, d)

    def _show_bc(self, xbc):
        """Hand the tap B before the GQA repeat (b, l, kv, n) and C (b, l, h, n), as the scan reads
        them (after the conv)."""
        b, l, _ = xbc.shape
        kvw = self.num_kv_heads * self.head_dim
        self.bc_tap(
            xbc[..., kvw : 2 * kvw].reshape(b, l, self.num_kv_heads, -1),
            xbc[..., 2 * kvw :].reshape(b, l, self.num_heads, -1),
        )

    def _decay(self, u, inputs=None):
        """(log-decay a (b, l, h) ≤ 0, input scale Δ (b, l, h) or None): a = Δ·A, Δ = softplus(W_Δ u + b_Δ)."""
        if self.sanity:
            return u.new_zeros(u.shape[0], u.shape[1], self.num_heads), None
        dt = F.softplus((self.dt_proj(u) if inputs is None else inputs["dt_proj"]).float())
        return dt * -torch.exp(self.A_log.float()), dt

    def _output(self, y, x, u, inputs=None):
        """y, x (b, l, h, p) → o_proj(gate/norm(y + D·x))."""
        if self.D is not None:
            y = y + self.D[:, None].to(y.dtype) * x
        y = y.flatten(2)
        if inputs is not None:
            z = inputs["gate"]
        else:
            z = self.gate(u) if self.gate is not None else None
        if self.norm is not None:
            y = self.norm(y, z)
        elif z is not None:
            y = y * F.silu(z)
        return self.o_proj(y)

    # -- forward forms ---------------------------------------------------------------------
    def forward_quadratic(self, hidden_states, position_embeddings=None, mask=None):
        """(output (b, l, hidden), mixing matrix M (b, h, l, l)) through the materialised form;
        y = M x (+ D x). Used by layer-local stages and plots; no cache."""
        xbc = self._xbc(hidden_states, position_embeddings)
        if self.conv is not None:
            xbc, _ = causal_conv1d(
                xbc, self.conv.weight, self.conv.bias, mask=mask, activation=self.conv_activation
            )
        x, B, C = self._split(xbc)
        a, dt = self._decay(hidden_states)
        x_in = x if dt is None else x * dt[..., None].to(x.dtype)
        y, M = ssd_quadratic(x_in, a.to(x.dtype), B, C, mask=mask, return_matrix=True)
        if dt is not None:  # fold Δ_s into the matrix so that y = M x
            M = M * dt.transpose(1, 2)[:, :, None, :].to(M.dtype)
        return self._output(y, x, hidden_states), M

    def step(self, u, position_embeddings, states: dict, mask=None, seen: int | None = None):
        """One token against the carried states (see ``AttentionLikeMixer``), the recurrence of the
        module docstring: (output, {"ssm": h_t, "conv": its window})."""
        new = {}
        inputs = self.project_inputs(u)
        xbc = self._xbc(u, position_embeddings, inputs)  # (b, 1, c)
        xbc, conv_state, m = conv_step(self.conv, xbc, states, mask, self.conv_activation)
        if conv_state is not None:
            new["conv"] = conv_state
        self._show_bc(xbc)
        x, B, C = self._split(xbc)  # (b, 1, h, ·)
        a, dt = self._decay(u, inputs)
        x_in = x.float() if dt is None else x.float() * dt[..., None]
        if m is not None:  # and leaves the state alone: decay 1, no input
            a, x_in = a * m, x_in * m[..., None]
        y, new["ssm"] = ssd_step(x_in[:, 0], a[:, 0].float(), B[:, 0].float(), C[:, 0].float(), states["ssm"])
        return self._output(y.to(x.dtype)[:, None], x, u, inputs), new

    def mix(self, hidden_states, position_embeddings, layer):
        b, l, _ = hidden_states.shape
        states = {} if layer is None else layer.states
        mask = self.padding_mask(l)
        inputs = self.project_inputs(hidden_states)
        pre_conv = self._xbc(hidden_states, position_embeddings, inputs)
        xbc, conv_state = apply_conv(
            self.conv, pre_conv, states, mask, self.conv_activation, self.context.kernels
        )
        self._show_bc(xbc)
        x, B, C = self._split(xbc)
        a, dt = self._decay(hidden_states, inputs)
        # the scan in float32 whatever the weights' dtype (as ``step`` and mamba_ssm's kernels): a
        # bfloat16 cumulative decay drifts, and the carried state stays float32 for the steps after
        x_in = x.float() if dt is None else x.float() * dt[..., None]
        y, ssm = ssd_chunked(
            x_in,
            a.float(),
            B.float(),
            C.float(),
            mask=mask,
            state=states.get("ssm"),
            chunk_size=self.chunk_size,
            backend=self.context.kernels,
        )
        if layer is not None and layer.record_past:  # a speculative verify: say how to stop after any prefix
            layer.set_rollback(
                lambda start, keep: self._states_after(start, keep, pre_conv, x_in, a, B, mask)
            )
        store_states(layer, ssm, conv_state, l)
        return self._output(y.to(x.dtype), x, hidden_states, inputs)

    def _states_after(self, start: dict, keep: int, pre_conv, x_in, a, B, mask) -> dict:
        """The states after the first ``keep`` tokens of a forward that began at ``start`` and
        computed these pre-conv rows, x·Δ, a and B (a speculative rollback, Mamba in the Llama §4:
        no projection or scan is run again)."""
        m = None if mask is None else mask[:, :keep]
        new = dict(start)
        new["ssm"] = ssd_state(x_in[:, :keep], a[:, :keep], B[:, :keep], mask=m, state=start.get("ssm"))
        if self.conv is not None:
            new["conv"] = causal_conv1d_state(
                pre_conv[:, :keep], self.conv.kernel, state=start.get("conv"), mask=m
            )
        return new
