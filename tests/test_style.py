"""The tree stays formatted and linted by ruff, as configured in pyproject.toml (line length 110;
pycodestyle, pyflakes, import order, bugbear): `ruff format src tests benchmarks` and
`ruff check --fix ...` make these pass."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["src", "tests", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode
    ):
        pytest.skip("ruff is not installed (it comes with the [test] extra)")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_tree_is_formatted():
    proc = _ruff("format", "--check")
    assert proc.returncode == 0, (
        "run `ruff format src tests benchmarks`:\n" + proc.stdout[-3000:] + proc.stderr[-1000:]
    )


def test_the_tree_passes_the_linter():
    proc = _ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, (
        "run `ruff check --fix src tests benchmarks`:\n" + proc.stdout[-3000:] + proc.stderr[-1000:]
    )
