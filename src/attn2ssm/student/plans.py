"""Layer plans: which layers keep attention and which get a mixer."""

from __future__ import annotations

from attn2ssm.errors import ConfigError
from attn2ssm.mixers.registry import ATTENTION, MIXERS


def interleaved_keep(num_layers: int, ratio: float) -> list[int]:
    """Indices of ``round(ratio·L)`` attention layers spread evenly over the depth (0 % → none)."""
    if not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"attention ratio {ratio} is outside [0, 1]", "use e.g. student.attention_ratio=0.25")
    n_keep = round(ratio * num_layers)
    return sorted({(i * num_layers) // n_keep for i in range(n_keep)}) if n_keep else []


def make_plan(num_layers: int, mixer: str, *, attention_ratio: float = 0.0, keep_attention: list[int] | None = None) -> list[str]:
    """One entry per layer: ``mixer`` or ``"attention"``. Explicit ``keep_attention`` wins over the ratio."""
    if mixer not in MIXERS:
        raise ConfigError(f"unknown mixer '{mixer}'", f"use one of: {', '.join(sorted(MIXERS))}")
    keep = interleaved_keep(num_layers, attention_ratio) if keep_attention is None else list(keep_attention)
    bad = [i for i in keep if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"keep_attention has layer indices {bad} outside 0..{num_layers - 1}", "list valid layer indices")
    return [ATTENTION if i in keep else mixer for i in range(num_layers)]
