"""Where an evaluation's files go, and what happens when they cannot go there.

Every ``eval`` mode checks its output up front (``paths.check_writable``: a read-only folder is one
line before any model loads). A write that fails anyway after the scoring (the disk filled, the
folder turned read-only meanwhile) must not lose the scores: :class:`KeptOutput` then writes them to
a new temporary folder and says where, and the command still prints its table.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from attn2ssm.paths import write_failure


class KeptOutput:
    """An output folder (or, with ``file=True``, file) at ``path`` that moves to a temporary folder
    the first time a write to it fails for want of space or permission. ``path`` is where the
    output is now; ``moved_from`` where it was meant to go (None while it has not moved)."""

    def __init__(self, path, *, file: bool = False):
        self.path, self.file = Path(path), file
        self.moved_from: Path | None = None

    def write(self, write: Callable[[Path], object]) -> Path:
        """``write(self.path)``; if that fails for want of space or permission, again at a new
        temporary location (a line on stderr says where). Returns where it was written."""
        try:
            write(self.path)
        except Exception as exc:
            cause = write_failure(exc)
            if cause is None or self.moved_from is not None:
                raise
            folder = Path(tempfile.mkdtemp(prefix="attn2ssm-eval-"))
            self.moved_from, self.path = self.path, folder / self.path.name if self.file else folder
            write(self.path)
            print(
                f"warning: cannot write to {self.moved_from} ({cause.strerror}); the scores are kept in {self.path}",
                file=sys.stderr,
            )
        return self.path
