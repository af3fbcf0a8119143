"""The unit of text every corpus reader returns: :mod:`.sources` (files, hub datasets) and
:mod:`.builtin` (the built-in corpora) both build it, so it lives below both."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Document:
    """One unit of text; ``id`` is stable and unique within its corpus."""

    id: str
    text: str
    meta: dict = field(default_factory=dict)
