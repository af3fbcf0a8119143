"""A read-only folder, for the tests of outputs that cannot be written. Root writes into read-only
folders, so these tests cannot fail as root and skip there (``not_as_root``); the injected cases
(``os.access`` / the write itself patched to refuse) cover it."""

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
