"""One exception family for every user-facing failure.

Each error carries a one-line message naming the problem and a fix; the CLI prints
``error: <message>`` without a traceback (``--debug`` shows it).
"""


class Attn2SSMError(Exception):
    """Base class: a problem the user can fix, described in one line."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} — {fix}" if fix else problem)


class ConfigError(Attn2SSMError):
    """A recipe, override or config value is wrong."""


class UnsupportedModelError(Attn2SSMError):
    """The teacher's architecture has no adapter."""


class DataError(Attn2SSMError):
    """A corpus is missing, empty, or does not fit the teacher."""


class TrainingError(Attn2SSMError):
    """Training cannot go on (non-finite loss, nothing to train, …)."""


class CheckpointError(Attn2SSMError):
    """A checkpoint or run directory is missing or damaged."""


class ExportError(Attn2SSMError):
    """A student cannot be written in the requested format (the reason and the nearest setting that can)."""


class OutputError(Attn2SSMError):
    """An output or run folder cannot be written: read-only, full, or in use by another process."""


class Interrupted(Attn2SSMError):
    """A run stopped on a signal once its work was saved; the CLI exits with ``exit_code`` (128 + the signal)."""

    def __init__(self, problem: str, fix: str | None = None, *, exit_code: int = 130):
        super().__init__(problem, fix)
        self.exit_code = exit_code
