"""The command line's contract, for every command group: bad input ends with exit code 2 and exactly one
stderr line ``error: <problem> — <fix>``, never a traceback (unless ``--debug``); a bad flag fails
before torch or transformers is even imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import TIMEOUT, assert_one_line_error, run_cli

BOTH = ("torch", "transformers")


CHEAP_ERRORS = [  # argv (OUT: a path in tmp_path), a needle of the error line, modules not imported by then
    (["convert", "--keep", "a", "--out", "OUT"], "--keep 'a'", BOTH),
    (["convert", "--teacher", "/nope/dir", "--out", "OUT"], "teacher path not found", BOTH),
    (["eval", "m", "--window", "1"], "--window 1 is too short", BOTH),
    (["eval", "m", "--tasks", "x", "--attention"], "different evaluations", BOTH),
    (["generate", "m", "--prompt", "x", "--max-new-tokens", "0"], "generates nothing", BOTH),
    (
        ["export", "m", "--format", "native", "--outtype", "f16", "--out", "OUT"],
        "--outtype is for --format gguf",
        BOTH,
    ),
    (["bench", "quality", "--corpora", ","], "names no corpus", BOTH),
    (["generate", "m", "--prompt", "x", "--temperature", "-1"], "--temperature", ("transformers",)),
    (["distill", "quikstart"], "no recipe 'quikstart'", ("transformers",)),
    (["bench", "train", "--precisions", "fp8"], "--precisions 'fp8'", ("transformers",)),
    (
        ["data", "shards", "sotu", "--out", str(Path(__file__).resolve().parent)],
        "already holds other files",
        BOTH,
    ),
    (["data", "shards", "generated:lots", "--out", "OUT"], "does not start with a number of tokens", BOTH),
    (["data", "shards", "/nope/corpus", "--out", "OUT"], "corpus path '/nope/corpus' does not exist", BOTH),
    (["data", "shards", "shards:/nope/shards", "--out", "OUT"], "holds no token shards", BOTH),
    (["data", "shards", "sotu", "--out", "OUT", "--teacher", "/nope/dir"], "teacher path not found", BOTH),
    (["data", "shards", "sotu", "--out", "OUT", "--teacher", "no-such-teacher"], "no built-in name", BOTH),
    (
        ["data", "shards", "sotu", "--out", "OUT", "--max-tokens", "lots"],
        "--max-tokens 'lots' is not a number of tokens",
        BOTH,
    ),
    (
        ["data", "shards", "sotu", "--out", "OUT", "--dtype", "bfloat16"],
        "--device and --dtype are for generated:",
        BOTH,
    ),
    (["data", "info", "OUT"], "holds no token shards", BOTH),
]


@pytest.mark.parametrize(
    ("argv", "needle", "not_imported"), [pytest.param(*case, id=" ".join(case[0])) for case in CHEAP_ERRORS]
)
def test_cheap_checks_fail_before_the_heavy_imports(tmp_path, argv, needle, not_imported):
    """A bad flag is one line in a fraction of a second: torch / transformers are not even imported."""
    code = (
        "import json, sys; from attn2ssm.cli import main; rc = main(sys.argv[1:]); "
        "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules))); sys.exit(rc)"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    argv = [str(tmp_path / "x") if a == "OUT" else a for a in argv]
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=TIMEOUT
    )
    assert_one_line_error(r, needle)
    imported = json.loads(r.stdout.splitlines()[-1])
    assert not set(imported) & set(not_imported), f"{' '.join(argv)} imported {imported} before failing"


def test_debug_shows_the_traceback(tmp_path):
    r = run_cli("--debug", "convert", "--teacher", "/nope/dir", "--out", tmp_path / "x")
    assert r.returncode not in (0, 2)
    assert "Traceback" in r.stderr
    assert "CheckpointError: teacher path not found: /nope/dir" in r.stderr
