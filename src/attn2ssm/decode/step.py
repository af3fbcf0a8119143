"""One decoder layer as the decode plan runs it: its parts (``Step``) and the rest of the layer once
its mixer has answered (``run_layer``). The eager plan (decode/plan.py) and the compiled step
(decode/compiled.py) share both."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Step(NamedTuple):
    """One layer as the plan runs it. ``mixer_norm`` / ``mlp_norm_out`` are the sandwich norms
    after the mixer and the MLP (None in a pre-norm layer); ``rope`` indexes the plan's position
    embeddings (``DecodePlan.position_embeddings``), None where the layer gets none."""

    index: int
    norm_in: nn.Module
    mixer: nn.Module
    mixer_norm: nn.Module | None
    mlp_norm_in: nn.Module
    mlp: nn.Module
    mlp_norm_out: nn.Module | None
    rope: int | None


def run_layer(step: Step, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The rest of a layer once its mixer gave y for input x (the eager plan and the compiled step
    share it)."""
    x = x + (y if step.mixer_norm is None else step.mixer_norm.forward(y))
    h = step.mlp.forward(step.mlp_norm_in.forward(x))
    return x + (h if step.mlp_norm_out is None else step.mlp_norm_out.forward(h))
