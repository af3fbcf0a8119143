"""CPU decode machinery: everything that makes one-token steps fast on CPU without changing what
a model computes. Depends on ``attn2ssm.mixers`` and ``attn2ssm.student``; neither imports it
(``Attn2SSMForCausalLM.enable_decode_plan`` is a thin entry point that defers to ``decode.plan``).

Light on purpose: importing ``attn2ssm.decode`` imports nothing heavy; the public functions
are looked up lazily from their modules.
"""

from __future__ import annotations

_LAZY = {
    "cpu_decode_layout": "attn2ssm.decode.layout",
    "undo_cpu_decode_layout": "attn2ssm.decode.layout",
    "standard_layout": "attn2ssm.decode.layout",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attn2ssm.decode' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
