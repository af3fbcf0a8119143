"""``attn2ssm data shards | info`` in-process and as a process: what it writes and prints, an
interrupted run that leaves nothing behind, the token-count and ``--fit-mib`` arithmetic.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from cli_run import TIMEOUT


def test_data_shards_and_info(tiny_setup, tmp_path, capsys):
    """`data shards` writes a corpus and teacher samples as token shards and says what it wrote; `data
    info` reads the manifest back, hashes the files and checks the tokenizer; both read in a recipe."""
    import socket

    from attn2ssm.cli import main
    from attn2ssm.data.shards import read_manifest

    teacher, corpus = tiny_setup
    # what a SIGKILLed writer left (no such pid)
    killed = tmp_path / f".text.shards-abcd1234.{2**22 + 7}@{socket.gethostname()}"
    killed.mkdir()
    assert (
        main(
            [
                "data",
                "shards",
                str(corpus),
                "--out",
                str(tmp_path / "text"),
                "--teacher",
                str(teacher),
                "--heldout-tokens",
                "300",
            ]
        )
        == 0
    )
    assert not killed.exists()
    printed = capsys.readouterr().out.splitlines()
    manifest = read_manifest(tmp_path / "text")
    n_train = sum(f["tokens"] for f in manifest["sides"]["train"])
    assert (
        printed[0]
        == f"{tmp_path / 'text'}: token shards of {str(corpus)!r}, {(n_train + 300) * 2 / 1024:.1f} KiB"
    )
    assert printed[2].split() == [
        "train",
        f"{n_train:,}",
        "tokens",
        "in",
        "1",
        "file",
        "(" + f"{n_train * 2 / 1024:.1f}",
        "KiB)",
    ]
    assert printed[3].split()[:2] == ["held-out", "300"] and printed[-1].startswith(
        f"use it: data.corpus: shards:{tmp_path / 'text'}"
    )

    spec = "generated:3000?length=24&batch=8"
    assert (
        main(
            [
                "data",
                "shards",
                spec,
                "--out",
                str(tmp_path / "gen"),
                "--teacher",
                str(teacher),
                "--max-tokens",
                "2k",
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        "train            2,000 tokens in 1 file" in printed
        and "batch 8 on cpu (float32)" in printed
        and "tokens/s" in printed
    )

    assert main(["data", "info", str(tmp_path / "gen"), "--verify", "--teacher", str(teacher)]) == 0
    printed = capsys.readouterr().out
    assert "verified: all 2 files match their size and SHA-256" in printed and "the ids belong to" in printed
    assert main(["data", "shards", "sotu", "--out", str(tmp_path / "gen"), "--teacher", str(teacher)]) == 2
    assert "already holds token shards" in capsys.readouterr().err
    assert (
        main(
            [
                "data",
                "shards",
                str(tmp_path / "gen"),
                "--out",
                str(tmp_path / "again"),
                "--teacher",
                str(teacher),
            ]
        )
        == 2
    )
    assert (
        f"holds token shards, not text files — name it shards:{tmp_path / 'gen'}" in capsys.readouterr().err
    )
    assert (
        main(
            [
                "data",
                "shards",
                f"shards:{tmp_path / 'gen'}",
                "--out",
                str(tmp_path / "cut"),
                "--teacher",
                str(teacher),
                "--fit-mib",
                "0.07",
            ]
        )
        == 0
    )
    # room for 3,932 ids, 122 held out: all 2,000 training ones fit
    assert "train            2,000 tokens" in capsys.readouterr().out
    assert sum(f.stat().st_size for f in (tmp_path / "cut").iterdir()) <= 0.07 * 2**20


def test_data_shards_interrupted_leaves_nothing(tiny_setup, tmp_path):
    """SIGTERM while the teacher samples: exit 143 (as distill), no folder at --out and no staging folder beside it."""
    import signal
    import time

    teacher, _ = tiny_setup
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "gen"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "attn2ssm",
            "data",
            "shards",
            "generated:100000000?length=32&batch=4",
            "--out",
            str(out),
            "--teacher",
            str(teacher),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while (
            not [p for p in tmp_path.iterdir() if p.name.startswith(".gen.shards-")]
            and time.monotonic() < deadline
            and proc.poll() is None
        ):
            time.sleep(0.2)
        time.sleep(1.0)  # some batches written
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped on SIGTERM: no token shards were written to") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_data_token_counts_and_fitting_a_transfer():
    from attn2ssm.cli.data import fit_limits, token_count
    from attn2ssm.errors import ConfigError

    assert [token_count("--max-tokens", t) for t in ("123", "30M", "1.5k", "2^25", "2 ^ 10", "1G", None)] == [
        123,
        30_000_000,
        1500,
        1 << 25,
        1024,
        10**9,
        None,
    ]
    with pytest.raises(ConfigError, match="not a number of tokens"):
        token_count("--max-tokens", "-5")
    train, held = fit_limits(64, 2, None, None)  # 64 MiB at 16 bits, 64 KiB left for the manifest
    assert train + held == ((64 << 20) - (64 << 10)) // 2 == 33_521_664 and held == 33_521_664 // 32
    assert fit_limits(64, 2, 1000, 50) == (1000, 50) and fit_limits(64, 4, None, 100) == (
        ((64 << 20) - (64 << 10)) // 4 - 100,
        100,
    )
    with pytest.raises(ConfigError, match="raise --fit-mib"):
        fit_limits(0.05, 2, None, None)
