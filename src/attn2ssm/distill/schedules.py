"""Learning-rate multipliers as functions of the optimizer step."""

from __future__ import annotations

import math


def lr_multiplier(kind: str, total_steps: int, warmup: float, decay: float = 0.2, min_ratio: float = 0.1):
    """Return f(step) → multiplier of the peak lr. ``warmup``/``decay`` < 1 are fractions of the steps."""
    total = max(1, total_steps)
    warm = int(round(warmup * total)) if warmup < 1 else int(warmup)
    tail = int(round(decay * total)) if decay < 1 else int(decay)

    def warmup_factor(step: int) -> float:
        return (step + 1) / warm if warm and step < warm else 1.0

    def f(step: int) -> float:
        if kind == "constant":
            return warmup_factor(step)
        if step < warm:
            return warmup_factor(step)
        if kind == "warmup_cosine":
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        if kind == "wsd":  # warmup, stable at peak, then linear decay over the last `tail` steps
            start = total - tail
            if step < start or tail == 0:
                return 1.0
            return 1.0 - (1 - min_ratio) * min(1.0, (step - start + 1) / tail)
        raise ValueError(f"unknown schedule {kind}")

    return f
