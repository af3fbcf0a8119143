"""CPU decode machinery: everything that makes one-token steps fast on CPU without changing what
a model computes. Depends on ``attn2ssm.mixers`` and ``attn2ssm.student``; neither imports it.
It attaches itself to a model (``cpu_decode_layout(model)``, ``enable_decode_plan(model)``) by
swapping module classes for decode-mode subclasses, and ``undo_cpu_decode_layout`` detaches it.

Light on purpose: importing ``attn2ssm.decode`` imports nothing heavy; the public functions
are looked up lazily from their modules.
"""

from __future__ import annotations

_LAZY = {
    "cpu_decode_layout": "attn2ssm.decode.layout",
    "undo_cpu_decode_layout": "attn2ssm.decode.layout",
    "enable_decode_plan": "attn2ssm.decode.plan",
    "disable_decode_plan": "attn2ssm.decode.plan",
    "compiled_step_status": "attn2ssm.decode.plan",
    "standard_layout": "attn2ssm.decode.fusion",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attn2ssm.decode' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
