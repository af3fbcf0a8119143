"""Mixer kinds by name, as a layer plan names them."""

from __future__ import annotations

import inspect

from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.bimamba import BiMambaMixer
from attn2ssm.mixers.discrete_mamba2 import DiscreteMamba2Mixer
from attn2ssm.mixers.gated_delta import GatedDeltaMixer
from attn2ssm.mixers.hedgemamba import HedgeMambaMixer
from attn2ssm.mixers.linear_attention import LinearAttentionMixer
from attn2ssm.mixers.mamba import MambaMixer
from attn2ssm.mixers.mamba2 import Mamba2Mixer

MIXERS: dict[str, type[nn.Module]] = {
    cls.mixer_type: cls
    for cls in (
        LinearAttentionMixer,
        MambaMixer,
        Mamba2Mixer,
        DiscreteMamba2Mixer,
        HedgeMambaMixer,
        GatedDeltaMixer,
    )
}

# Non-causal mixers for encoders (vision transformers): never in a causal LM's plan.
ENCODER_MIXERS: dict[str, type[nn.Module]] = {BiMambaMixer.mixer_type: BiMambaMixer}

ATTENTION = "attention"  # a layer-plan entry that keeps the teacher's attention


def check_mixer_options(kind: str, options: dict | None) -> None:
    """Every key of ``options`` is a constructor option of mixer ``kind`` (a known one)."""
    valid = [
        n
        for n in inspect.signature({**MIXERS, **ENCODER_MIXERS}[kind].__init__).parameters
        if n not in ("self", "geometry", "layer_idx")
    ]
    unknown = sorted(set(options or {}) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} for mixer '{kind}'",
            f"valid options: {', '.join(valid)}",
        )


def build_mixer(kind: str, geometry: dict, layer_idx: int, options: dict | None = None) -> nn.Module:
    known = {**MIXERS, **ENCODER_MIXERS}
    if kind not in known:
        valid = ", ".join(sorted([*known, ATTENTION]))
        raise ConfigError(f"unknown mixer '{kind}' in the layer plan", f"use one of: {valid}")
    check_mixer_options(kind, options)
    return known[kind](geometry, layer_idx, **(options or {}))
