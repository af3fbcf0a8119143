"""A read-only folder, for the tests of outputs that cannot be written. Root writes into read-only
folders, so these tests cannot fail as root and skip there (``not_as_root``); the injected cases
(``os.access`` patched to refuse, ``deny_access``, or the write itself) cover it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

not_as_root = pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root writes into read-only folders: the chmod case cannot fail as root (the injected cases cover it)",
)


@contextlib.contextmanager
def read_only_folder(path: Path):
    """``path``, made and read-only (0555) for the block, writable again after it."""
    path.mkdir()
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def deny_access(monkeypatch, folder: Path) -> None:
    """``os.access`` answers no for ``folder`` (as if read-only, root included) and as before for any
    other path; the check attn2ssm makes before it writes, injected."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(folder) and real_access(path, mode))


@contextlib.contextmanager
def denied_before_the_teacher_loads(folder: Path):
    """For the block: ``os.access`` denies ``folder`` (``deny_access``) and loading a teacher fails the
    test (an --out that cannot be written is refused before the teacher loads)."""
    import attn2ssm.teachers

    with pytest.MonkeyPatch.context() as monkeypatch:
        deny_access(monkeypatch, folder)
        monkeypatch.setattr(
            attn2ssm.teachers,
            "load_teacher",
            lambda *a, **k: pytest.fail("the teacher loaded for an --out that cannot be written"),
        )
        yield
