"""Mixer kinds by name, as a layer plan names them."""

from __future__ import annotations

from torch import nn

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.bimamba import BiMambaMixer
from attn2ssm.mixers.discrete_mamba2 import DiscreteMamba2Mixer
from attn2ssm.mixers.gated_delta import GatedDeltaMixer
from attn2ssm.mixers.hedgemamba import HedgeMambaMixer
from attn2ssm.mixers.kept_heads import KeptHeadsMixer
from attn2ssm.mixers.linear_attention import LinearAttentionMixer
from attn2ssm.mixers.mamba import MambaMixer
from attn2ssm.mixers.mamba2 import Mamba2Mixer
from attn2ssm.mixers.options import check_options

MIXERS: dict[str, type[nn.Module]] = {
    cls.mixer_type: cls
    for cls in (
        LinearAttentionMixer,
        MambaMixer,
        Mamba2Mixer,
        DiscreteMamba2Mixer,
        HedgeMambaMixer,
        GatedDeltaMixer,
        KeptHeadsMixer,
    )
}

# Non-causal mixers for encoders (vision transformers): never in a causal LM's plan.
ENCODER_MIXERS: dict[str, type[nn.Module]] = {BiMambaMixer.mixer_type: BiMambaMixer}

ATTENTION = "attention"  # a layer-plan entry that keeps the teacher's attention


def mixer_class(kind: str) -> type[nn.Module]:
    """The class of mixer ``kind`` (causal or encoder); a ConfigError naming the valid kinds if unknown."""
    known = {**MIXERS, **ENCODER_MIXERS}
    if kind not in known:
        valid = ", ".join(sorted([*known, ATTENTION]))
        raise ConfigError(f"unknown mixer '{kind}' in the layer plan", f"use one of: {valid}")
    return known[kind]


def check_mixer_options(kind: str, options: dict | None) -> dict:
    """``options`` of mixer ``kind`` checked against the types its constructor declares
    (mixers/options.py): an unknown name or a wrong value is a ConfigError. Returns them as the
    mixer takes them."""
    return check_options(kind, mixer_class(kind), options)


def build_mixer(kind: str, geometry: dict, layer_idx: int, options: dict | None = None) -> nn.Module:
    return mixer_class(kind)(geometry, layer_idx, **check_mixer_options(kind, options))
