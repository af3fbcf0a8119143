"""Pieces the state-space mixers share: the parameters "Mamba in the Llama" adds to a converted attention
layer (Δ, A, conv, gate, D, gated norm) and how each is initialised.

Initialisations keep the converted layer close to its teacher: the conv passes the current
token through, the gate starts at 1 (zero weight, bias b with SiLU(b) = 1, as MOHAWK does),
Δ starts in [dt_min, dt_max] (Mamba's inverse-softplus bias), A is log-parameterised so it
stays negative; ``A_init`` (CAB's A ≈ 0) starts every decay exp(Δ·A) at ≈ 1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.ops.conv import causal_conv1d, causal_conv1d_step

# SiLU(b) = b·σ(b) = 1 at b ≈ 1.27846: a zero-weight gate with this bias multiplies by exactly 1.
GATE_IDENTITY_BIAS = 1.2784645427610738


def dt_bias_init(n: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> torch.Tensor:
    """Biases b with softplus(b) log-uniform in [dt_min, dt_max] (floored), as Mamba initialises Δ."""
    if not 0.0 < dt_min <= dt_max:
        raise ConfigError(
            f"dt_min={dt_min}, dt_max={dt_max} are not a valid range",
            "use 0 < dt_min <= dt_max, e.g. 0.001 and 0.1",
        )
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(floor)
    return dt + torch.log(-torch.expm1(-dt))  # inverse of softplus


def A_log_identity(kind: str, A_init: float | None) -> float | None:
    """log(−A_init): the A_log that starts A at ``A_init`` (CAB's A ≈ 0, so Ā = exp(Δ·A) ≈ 1
    and the scan is linear attention, Eq. 5); None keeps the mixer's default init."""
    if A_init is None:
        return None
    if isinstance(A_init, bool) or not isinstance(A_init, (int, float)) or not A_init < 0:
        raise ConfigError(
            f"{kind} option A_init={A_init!r} is not a negative number",
            "use a small negative A such as -1e-4 (A = −exp(A_log) cannot be 0), or null for the default",
        )
    return math.log(-A_init)


@torch.no_grad()
def init_identity_gate(gate: nn.Linear) -> None:
    """Make z = gate(u) the constant SiLU(z) = 1: zero weight, bias GATE_IDENTITY_BIAS."""
    gate.weight.zero_()
    gate.bias.fill_(GATE_IDENTITY_BIAS)


class CausalConv(nn.Module):
    """Depthwise causal conv weights (channels, kernel), initialised to pass the current token."""

    def __init__(self, channels: int, kernel: int, bias: bool = True):
        super().__init__()
        if kernel < 1:
            raise ConfigError(
                f"d_conv={kernel} is not a valid kernel size", "use d_conv >= 1 (4 in Mamba), or conv: false"
            )
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        # None: no bias (Qwen3.5's GDN conv has none)
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.zero_()
        self.weight[:, -1] = 1.0  # the last tap is the current token
        if self.bias is not None:
            self.bias.zero_()


class GatedRMSNorm(nn.Module):
    """Mamba-2's gated norm, per head: RMSNorm(y · SiLU(z)) · w over each head's p channels."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.eps = num_heads, eps
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.weight.fill_(1.0)

    def forward(self, y: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """y, z: (b, l, h·p) → (b, l, h·p)."""
        if z is not None:
            y = y * F.silu(z.float()).to(y.dtype)
        b, l, width = y.shape
        yf = y.float().view(b, l, self.num_heads, -1)
        yf = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (yf.view(b, l, width) * self.weight.float()).to(y.dtype)


# ``norm_eps: auto``: the teacher's own norm ε, resolved when a student is built (``resolve_norm_eps``),
# so the saved options hold the number. Native hybrid classes use the config's one rms_norm_eps for
# the gated norm too (student/native_export.py), so this is the setting a servable student needs.
AUTO = "auto"


def check_norm_eps(kind: str, eps) -> float:
    """The gated norm's ε as a float; a ConfigError unless it is a positive number (YAML reads
    ``1e-5`` without a dot as a string: taken as the number it spells)."""
    if eps == AUTO:
        raise ConfigError(
            f"{kind} option norm_eps: auto reached a mixer built without its teacher",
            "build students through attn2ssm.student.convert (it resolves auto), or give a number such as 1.0e-5",
        )
    if isinstance(eps, str):
        try:
            eps = float(eps)
        except ValueError:
            pass
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(
            f"{kind} option norm_eps={eps!r} is not a positive number",
            "use auto (the teacher's rms_norm_eps), a number such as 1.0e-5, or leave it out (1e-6)",
        )
    return float(eps)


def teacher_norm_eps(config) -> float | None:
    """The teacher's block-norm ε from its config (object or dict): ``rms_norm_eps``, else a
    LayerNorm family's ``layer_norm_eps`` / ``layer_norm_epsilon``; None when it has none."""
    for name in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def resolve_norm_eps(kind: str, options: dict | None, config) -> dict:
    """``options`` with ``norm_eps: auto`` replaced by the teacher's norm ε (``config``: the teacher's
    config or a student's ``base_config``); other values are left for the mixer to check."""
    options = dict(options or {})
    if options.get("norm_eps") != AUTO:
        return options
    eps = teacher_norm_eps(config)
    if eps is None:
        raise ConfigError(
            f"{kind} option norm_eps: auto needs the teacher's rms_norm_eps, and its config has none",
            "give the gated norm's ε as a number, e.g. norm_eps: 1.0e-5",
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ConfigError(
            f"{kind} option norm_eps: auto found the teacher's norm ε {eps!r}, not a positive number",
            "give norm_eps as a positive number, e.g. 1.0e-5",
        )
    options["norm_eps"] = float(eps)
    return options


def check_activation(name: str | None) -> str | None:
    if name in (None, "none", "identity"):
        return None
    if name != "silu":
        raise ConfigError(f"conv_activation={name!r} is not supported", "use silu or none")
    return name


@torch.no_grad()
def init_shared_parameters(mixer) -> None:
    """The designed start of the parts every SSM mixer may have: conv, gate, gated norm, D."""
    if getattr(mixer, "conv", None) is not None:
        mixer.conv.reset_parameters()
    if getattr(mixer, "gate", None) is not None:
        if mixer.gate.bias is not None:
            init_identity_gate(mixer.gate)
        else:  # no bias (Mamba-2's gate_bias: false): SiLU(0) = 0 would silence the mixer, so nn.Linear's init
            mixer.gate.reset_parameters()
    if getattr(mixer, "norm", None) is not None:
        mixer.norm.reset_parameters()
    if getattr(mixer, "D", None) is not None:
        mixer.D.fill_(mixer.D_init)


def apply_conv(conv: CausalConv | None, x, states: dict, mask, activation, backend: str = "torch"):
    """x (b, l, c) through the mixer's causal conv, continuing from ``states["conv"]`` if there is
    one. Returns (x, new conv state or None without a conv). (A one-token ``step`` calls
    ``conv_step``.) ``backend``: the kernels (ops/kernels.py)."""
    if conv is None:
        return x, None
    return causal_conv1d(
        x, conv.weight, conv.bias, state=states.get("conv"), mask=mask, activation=activation, backend=backend
    )


class ConvRecurrence:
    """Mixin of the recurrent mixers with an optional short causal conv (Mamba, Mamba-2, HedgeMamba,
    the gated delta rule): ``step`` needs the recurrent state and, with a conv, its window."""

    def can_step(self, layer) -> bool:
        return "ssm" in layer.states and (self.conv is None or "conv" in layer.states)


def conv_step(conv: CausalConv | None, x, states: dict, mask, activation):
    """One token x (b, 1, c) through the causal conv against ``states["conv"]``. Returns (x, new conv
    state or None without a conv, m): ``m`` (b, 1, 1) float32 from ``mask`` (b, 1), or None. A
    padded token enters the conv window as 0 (as in the chunked form); the caller uses ``m`` to leave
    its recurrent state alone for that row."""
    m = None if mask is None else mask.to(torch.float32).view(-1, 1, 1)
    if m is not None:
        x = x * m.to(x.dtype)
    if conv is None:
        return x, None, m
    x, state = causal_conv1d_step(x[:, 0], conv.weight, conv.bias, states["conv"], activation=activation)
    return x[:, None], state, m


def store_states(layer, ssm, conv_state, length: int) -> None:
    """Save a mixer's recurrent states in its cache layer (if it runs with one) and count the tokens."""
    if layer is None:
        return
    layer.states["ssm"] = ssm
    if conv_state is not None:
        layer.states["conv"] = conv_state
    layer.advance(length)
