"""``attn2ssm convert --out`` (in-process CLI): a directory that already holds a model or a run is
not overwritten without ``--force``, and with it the new student replaces the old one only once it
is completely written."""

import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from read_only import denied_before_the_teacher_loads, not_as_root, read_only_folder
from tiny_models import save_tiny_teacher


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    save_tiny_teacher(path)
    return path


def _digest(directory) -> dict:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " — " in lines[0], lines
    return lines[0]


def _convert(teacher_dir, out, *flags) -> int:
    return main(["convert", "--teacher", str(teacher_dir), "--out", str(out), *flags])


@pytest.mark.parametrize("held", ["student", "run"])
def test_an_out_that_holds_a_model_or_a_run_is_refused(teacher_dir, tmp_path, capsys, held):
    out = tmp_path / "out"
    if held == "student":
        assert _convert(teacher_dir, out) == 0
    else:  # what `attn2ssm distill --out` leaves
        (out / "checkpoints" / "step-1").mkdir(parents=True)
        (out / "student").mkdir()
    before = _digest(out)
    capsys.readouterr()
    assert _convert(teacher_dir, out, "--mixer", "mamba2") == 2
    line = _one_error_line(capsys)
    assert str(out) in line and "already holds" in line and "--force" in line
    assert _digest(out) == before


def test_force_replaces_the_model_and_leaves_nothing_beside_it(teacher_dir, tmp_path):
    out = tmp_path / "out"
    assert _convert(teacher_dir, out) == 0
    (out / "stale-note.txt").write_text("from the old student")
    assert _convert(teacher_dir, out, "--mixer", "mamba2", "--force") == 0
    assert json.loads((out / "config.json").read_text())["layer_plan"] == ["mamba2", "mamba2"]
    assert not (out / "stale-note.txt").exists()  # the directory is the new student, not a mix
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old copy left
    assert AutoModelForCausalLM.from_pretrained(out).config.layer_plan == ["mamba2", "mamba2"]


def test_a_failed_forced_write_leaves_the_old_student(teacher_dir, tmp_path, monkeypatch):
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    out = tmp_path / "out"
    assert _convert(teacher_dir, out) == 0
    before = _digest(out)
    original = Attn2SSMForCausalLM.save_pretrained

    def dies_halfway(self, directory, *args, **kwargs):
        original(self, directory, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(Attn2SSMForCausalLM, "save_pretrained", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        _convert(teacher_dir, out, "--mixer", "mamba2", "--force")
    assert _digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_or_empty_out_needs_no_force(teacher_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "a" / "b"):
        assert _convert(teacher_dir, out) == 0
        assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()


# ------------------------------------------------------------------ a full disk, a read-only --out, a killed convert
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_full_disk_is_one_line_and_keeps_the_old_student(teacher_dir, tmp_path, monkeypatch, capsys):
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    out = tmp_path / "out"
    assert _convert(teacher_dir, out) == 0
    before = _digest(out)

    def fills_the_disk(self, directory, *args, **kwargs):
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Attn2SSMForCausalLM, "save_pretrained", fills_the_disk)
    capsys.readouterr()
    assert _convert(teacher_dir, out, "--mixer", "mamba2", "--force") == 2
    assert _one_error_line(capsys) == (
        f"error: cannot write the student to {out}: No space left on device — free space on its disk, "
        "then run the command again (what --out held is unchanged)"
    )
    assert _digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left


@not_as_root
def test_a_read_only_parent_is_refused(teacher_dir, tmp_path, capsys):
    with read_only_folder(tmp_path / "ro") as parent:
        assert _convert(teacher_dir, parent / "out") == 2
    assert _one_error_line(capsys).startswith(f"error: --out {parent / 'out'}: {parent} is not writable")


def test_an_unwritable_out_is_one_line_before_the_teacher_loads_or_while_writing(
    teacher_dir, tmp_path, monkeypatch, capsys
):
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    out = tmp_path / "new" / "out"
    with denied_before_the_teacher_loads(tmp_path):  # as if tmp_path were read-only
        assert _convert(teacher_dir, out) == 2
    assert (
        _one_error_line(capsys)
        == f"error: --out {out}: {tmp_path} is not writable (permission denied) — choose another --out, or make {tmp_path} writable"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    # access(2) said yes, the write says no (ACLs, NFS root squash, a race)
    def denied(self, directory, *args, **kwargs):
        raise PermissionError(
            errno.EACCES, os.strerror(errno.EACCES), str(Path(directory) / "model.safetensors")
        )

    monkeypatch.setattr(Attn2SSMForCausalLM, "save_pretrained", denied)
    assert _convert(teacher_dir, out) == 2
    assert _one_error_line(capsys).startswith(
        f"error: cannot write the student to {out}: Permission denied — make {out} writable"
    )
    assert sorted(p.name for p in out.parent.iterdir()) == []


def test_a_killed_converts_staging_is_removed_and_a_live_ones_kept(teacher_dir, tmp_path):
    host = socket.gethostname()
    stale = tmp_path / f".out.convert-abc123.{_dead_pid()}@{host}"  # convert --force SIGKILLed while saving
    live = tmp_path / f".out.convert-def456.{os.getpid()}@{host}"  # a convert still writing
    for staging in (stale, live):
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"\0" * 4096)
    assert _convert(teacher_dir, tmp_path / "out") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


# ------------------------------------------------------------------ issue 46: options, seed, one writer, modes, staging
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--option", "window=abc"], "option window='abc' is not an integer >= 0"),
        (["--option", "chunk_size=abc"], "option chunk_size='abc' is not a positive integer"),
        (["--option", "chunk_size=0"], "option chunk_size=0 is not a positive integer"),
        (["--mixer", "mamba", "--option", "dt_min=abc"], "option dt_min='abc' is not a positive number"),
    ],
)
def test_a_mixer_option_of_the_wrong_type_is_one_line_before_the_teacher_loads(
    teacher_dir, tmp_path, monkeypatch, capsys, flags, needle
):
    import attn2ssm.teachers

    monkeypatch.setattr(
        attn2ssm.teachers, "load_teacher", lambda *a, **k: pytest.fail("the teacher loaded for a bad option")
    )
    assert _convert(teacher_dir, tmp_path / "out", *flags) == 2
    line = _one_error_line(capsys)
    assert needle in line and "set " in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, not even --out


def test_the_seed_makes_the_new_weights_the_same_each_time(teacher_dir, tmp_path):
    """mamba2's Δ bias and A are drawn at random: the default seed (0) gives the same bytes twice, another seed others."""
    for name, flags in (("a", []), ("b", []), ("c", ["--seed", "1"])):
        assert _convert(teacher_dir, tmp_path / name, "--mixer", "mamba2", *flags) == 0
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] and weights["a"] != weights["c"]


def test_a_second_convert_into_a_held_out_is_refused(teacher_dir, tmp_path, capsys):
    from attn2ssm.paths import LOCK, lock_dir

    out = tmp_path / "out"
    held = lock_dir(out)  # as a first convert (or a run) still writing there holds it
    try:
        capsys.readouterr()
        assert _convert(teacher_dir, out) == 2
        line = _one_error_line(capsys)
        assert "another process" in line and f"is using {out}" in line, line
        assert sorted(p.name for p in out.iterdir()) == [LOCK]  # the second wrote nothing
    finally:
        held.close()
    (out / LOCK).unlink()
    assert _convert(teacher_dir, out) == 0  # once the first is done
    assert (out / "config.json").is_file() and not (out / LOCK).exists()  # no lock file in a student


@pytest.mark.parametrize(("umask", "folder", "file"), [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_the_student_gets_the_umasks_permissions(teacher_dir, tmp_path, umask, folder, file):
    old = os.umask(umask)
    try:
        assert _convert(teacher_dir, tmp_path / "out") == 0
        assert _convert(teacher_dir, tmp_path / "out", "--mixer", "mamba2", "--force") == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == folder
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).stat().st_mode & 0o777 == file, name


def test_a_killed_converts_staging_is_removed_by_a_convert_that_is_refused(teacher_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert _convert(teacher_dir, out) == 0
    stale = tmp_path / f".out.convert-abc123.{_dead_pid()}@{socket.gethostname()}"  # a killed convert --force
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    capsys.readouterr()
    assert _convert(teacher_dir, out, "--mixer", "mamba2") == 2  # no --force: refused
    assert "already holds" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
