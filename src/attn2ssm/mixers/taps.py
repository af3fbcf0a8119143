"""Taps: named points where a mixer shows an inner value to whoever hooks them.

A training method sometimes needs a value from inside a mixer — CAB aligns each Mamba layer's B
and C with the teacher's K and Q. The mixer does not know about the method: it calls its tap with
the values, ``self.bc_tap(B, C)``, and a stage that wants them registers a forward hook on the tap
(``mixer.bc_tap.register_forward_hook(fn)``; ``fn(tap, (B, C), None)``) and removes it afterwards.
Without a hook the call does nothing. A tap has no parameters or buffers, so state dicts are the
same with or without it.
"""

from __future__ import annotations

from torch import nn


class Tap(nn.Module):
    """``tap(*values)`` returns None; forward hooks on it read ``values`` (their ``args``)."""

    def forward(self, *values) -> None:
        return None
