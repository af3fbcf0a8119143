"""What the op-form tests share (docs/design.md, "The forms of an op"): a left-padding mask, and a
chunked form run over a sequence in pieces with its state carried from one piece to the next, whose
outputs must equal one pass over the whole sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def left_padding(b: int, l: int, pads: Sequence[int]) -> torch.Tensor:
    """A (b, l) mask of ones whose row i starts with ``pads[i]`` zeros (padding on the left)."""
    mask = torch.ones(b, l)
    for i, p in enumerate(pads):
        mask[i, :p] = 0
    return mask


def in_pieces(run: Callable, cuts: Sequence[int], state=None, dim: int = 1):
    """``run(part, state) -> (out, state)`` on the pieces ``[0, cuts[0])``, ``[cuts[0], cuts[1])``, …
    (``part`` a slice of the time axis), each starting from the state the one before left;
    (the outputs concatenated along ``dim``, the last state)."""
    outs, start = [], 0
    for end in cuts:
        out, state = run(slice(start, end), state)
        outs.append(out)
        start = end
    return torch.cat(outs, dim), state
