"""model_type -> adapter lookup, the one entry point the rest of attn2ssm uses.

Family modules register themselves with ``@register_adapter``; ``get_adapter`` turns an
unknown architecture into a one-line UnsupportedModelError instead of a deep AttributeError.
"""

from __future__ import annotations

from attn2ssm.adapters.common import Adapter
from attn2ssm.errors import UnsupportedModelError

_BY_MODEL_TYPE: dict[str, type[Adapter]] = {}

# model_types that are close to a supported one, with the way to get there.
_HINTS = {
    "gemma3": "load the text-only Gemma3ForCausalLM (model_type 'gemma3_text') instead of the multimodal model",
}


def register_adapter(cls: type[Adapter], *, replace: bool = False) -> type[Adapter]:
    """Register ``cls`` for each of its ``model_types``; usable as a class decorator.

    Registering a different class for a model_type that is already taken raises unless
    ``replace=True``, so two adapters never silently fight over one architecture.
    """
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        raise TypeError(f"{cls!r} is not an Adapter subclass")
    if not cls.family or not cls.model_types:
        raise TypeError(f"{cls.__name__} must set class attributes `family` and `model_types`")
    for model_type in cls.model_types:
        taken = _BY_MODEL_TYPE.get(model_type)
        if taken is not None and taken is not cls and not replace:
            raise ValueError(
                f"model_type {model_type!r} already has adapter {taken.__name__}; pass replace=True to override"
            )
    for model_type in cls.model_types:
        _BY_MODEL_TYPE[model_type] = cls
    return cls


def supported_families(encoders: bool = False) -> list[str]:
    """Sorted decoder family names, e.g. ["gemma", "gemma2", …, "qwen2"]; with ``encoders`` also
    the encoder families (adapters with ``encoder = True``: ViT/DeiT, distilled into image classifiers)."""
    return sorted(
        {cls.family for cls in _BY_MODEL_TYPE.values() if encoders or not getattr(cls, "encoder", False)}
    )


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def _family_list() -> str:
    """Families for messages, with their model_types where those differ: "gemma3 (gemma3_text), llama, …"."""
    parts = []
    for family in supported_families(encoders=True):
        types = sorted(t for t, cls in _BY_MODEL_TYPE.items() if cls.family == family)
        parts.append(family if types == [family] else f"{family} ({', '.join(types)})")
    return ", ".join(parts)


def get_adapter(model_or_config) -> Adapter:
    """The adapter for a model (anything with ``.config``) or a transformers config."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    cls = _BY_MODEL_TYPE.get(model_type)
    if cls is None:
        fix = _HINTS.get(model_type, "use a teacher from a supported family or register an adapter for it")
        raise UnsupportedModelError(
            f"no adapter for model_type {model_type!r} (supported families: {_family_list()})", fix
        )
    adapter = cls()
    adapter.validate(config)
    return adapter
