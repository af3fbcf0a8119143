"""Running ``python -m attn2ssm …`` as a user does, for the command-line tests in tests/cli/.

The product rule under test: bad input ends with exit code 2 and exactly one stderr line
``error: <problem> — <fix>``, never a traceback (unless ``--debug``). Every run is offline
(HF_HUB_OFFLINE=1) and uses this session's private ATTN2SSM_CACHE.
"""

from __future__ import annotations

import os
import subprocess
import sys

TIMEOUT = 300


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert env.get("ATTN2SSM_CACHE"), "conftest gives every session a private ATTN2SSM_CACHE"
    return subprocess.run(
        [sys.executable, "-m", "attn2ssm", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2, stderr is exactly one line ``error: …`` containing every needle, no traceback."""
    where = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 2, where
    assert "Traceback" not in result.stderr, where
    lines = result.stderr.splitlines()
    assert len(lines) == 1, where
    line = lines[0]
    assert line.startswith("error: "), where
    assert " — " in line, f"no fix given: {line}"  # Attn2SSMError's "<problem> — <fix>"
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def result_of(slow, name: str) -> subprocess.CompletedProcess:
    return slow[name].result(timeout=TIMEOUT * 2)


def assert_past_positions_error(slow, ws, capsys, argv, needles) -> None:
    """In-process: the converted hybrid keeps an attention layer, so it reads at most the teacher's 64
    positions; ``argv`` (STUDENT and LLAMA standing for the two models) asks for more and must end
    in one line holding every needle, with nothing generated."""
    from attn2ssm.cli import main

    assert result_of(slow, "convert").returncode == 0
    capsys.readouterr()
    argv = [{"STUDENT": str(slow["student_dir"]), "LLAMA": str(ws.llama)}.get(a, a) for a in argv]
    assert main([*argv, *(["--corpus", str(ws.corpus)] if argv[0] == "eval" else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: ")
        and " — " in err[0]
        and all(n in err[0] for n in needles)
    ), err
    assert not captured.out  # nothing generated
