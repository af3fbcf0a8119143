"""``attn2ssm.paths``: writes that leave nothing half-done, staging that a later run can prove stale,
the run-directory lock, and failed writes turned into one line."""

import errno
import os
import socket
import subprocess
import sys

import pytest

from attn2ssm.errors import OutputError
from attn2ssm.paths import (
    atomic_write_text,
    check_writable,
    lock_beside,
    lock_dir,
    owner_tag,
    remove_stale_staging,
    replace_dir,
    staging_beside,
    write_failure,
    writing,
)
from read_only import not_as_root, read_only_folder


def dead_pid() -> int:
    """The pid of a process of this host that has ended (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------------- atomic writes, staging
def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "recipe.yaml"
    path.write_text("old")
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_staging_names_carry_their_writer(tmp_path):
    with staging_beside(tmp_path / "out", "convert") as folder:
        assert (
            folder.parent == tmp_path
            and folder.name.startswith(".out.convert-")
            and folder.name.endswith(f".{owner_tag()}")
        )
        (folder / "model.safetensors").write_bytes(b"x")
    assert list(tmp_path.iterdir()) == []  # removed with what it held


def test_stale_staging_is_removed_and_live_or_foreign_staging_is_kept(tmp_path):
    host, dead = socket.gethostname(), dead_pid()
    names = {
        "stale_convert": f".out.convert-abc123.{dead}@{host}",
        "stale_export": f".other.export-x_y.{dead}@{host}",
        "stale_tmp_file": f".results.json.tmp-{dead}@{host}",
        "live": f".out.convert-def456.{os.getpid()}@{host}",  # this very process: still writing
        "other_host": f".out.convert-ghi789.{dead}@not-{host}",  # cannot be proven dead from here
        "untagged": ".out.convert-jkl012",  # an older attn2ssm's: no writer recorded
        "trainer_tmp": ".tmp-student",  # protected by the run lock, not by a tag
    }
    for key, name in names.items():
        if key == "stale_tmp_file":
            (tmp_path / name).write_text("{")
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
    removed = remove_stale_staging(tmp_path)
    assert sorted(removed) == sorted(names[k] for k in ("stale_convert", "stale_export", "stale_tmp_file"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "other_host", "untagged", "trainer_tmp")
    )
    # the lock holder owns its .tmp-* folders
    assert remove_stale_staging(tmp_path, locked=True) == [".tmp-student"]


def test_an_old_output_set_aside_comes_back_when_its_replacement_never_arrived(tmp_path):
    host, dead = socket.gethostname(), dead_pid()
    (tmp_path / f".student.old-{dead}@{host}").mkdir()  # killed between replace_dir's two renames
    (tmp_path / f".student.old-{dead}@{host}" / "config.json").write_text("old")
    (tmp_path / "native").mkdir()  # killed after them, before deleting the old copy
    (tmp_path / f".native.old-{dead}@{host}").mkdir()
    assert remove_stale_staging(tmp_path) == [f".native.old-{dead}@{host}"]
    assert (tmp_path / "student" / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native", "student"]


def test_replace_dir_sets_the_old_copy_aside_under_a_tag(tmp_path, monkeypatch):
    (tmp_path / "new").mkdir()
    (tmp_path / "out").mkdir()
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst)))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    replace_dir(tmp_path / "new", tmp_path / "out")
    assert seen == [("out", f".out.old-{owner_tag()}"), ("new", "out")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------------------------ the lock
HOLDER = "import sys, time\nfrom attn2ssm.paths import lock_dir\nfh = lock_dir(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(600)\n"


def test_a_run_directory_is_held_by_one_process_and_freed_when_it_dies(tmp_path):
    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputError) as err:
            lock_dir(folder)
        message = str(err.value)
        assert (
            f"another process (pid {holder.pid} on {socket.gethostname()}) is using {folder}" in message
            and " — " in message
        )
    finally:
        holder.kill()  # SIGKILL: no chance to unlock
        holder.wait()
    fh = lock_dir(folder)  # the OS released it: no stale lock
    assert (folder / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    fh.close()


# ---------------------------------------------------------------------------------- failed writes
def test_write_failure_finds_the_os_reason_however_it_is_wrapped():
    assert write_failure(OSError(errno.ENOSPC, "No space left on device")).errno == errno.ENOSPC
    try:  # torch.save over a file object: its RuntimeError is raised while handling the file's OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # noqa: B904
    except RuntimeError as exc:
        wrapped = exc
    assert write_failure(wrapped).errno == errno.ENOSPC
    # safetensors
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(rust).errno == errno.ENOSPC
    assert write_failure(OSError("disk full")) is None  # no errno: not recognisable
    assert write_failure(RuntimeError("shape mismatch")) is None
    denied = PermissionError(errno.EACCES, "Permission denied", "/elsewhere/corpus.txt")
    assert write_failure(denied, "/runs") is None  # a read outside the output is not the output's fault
    assert (
        write_failure(PermissionError(errno.EACCES, "Permission denied", "/runs/x/recipe.yaml"), "/runs")
        is not None
    )


def test_writing_turns_a_full_disk_into_one_line(tmp_path):
    out = tmp_path / "student"
    with pytest.raises(OutputError) as err:
        with writing(out, "the student", "run the command again"):
            no_space()
    assert (
        str(err.value)
        == f"cannot write the student to {out}: No space left on device — free space on its disk, then run the command again"
    )
    with pytest.raises(PermissionError):  # a denied read elsewhere passes through
        with writing(out, "the student", "run the command again"):
            raise PermissionError(errno.EACCES, "Permission denied", "/elsewhere/teacher/config.json")
    with pytest.raises(ValueError):
        with writing(out, "the student", "run the command again"):
            raise ValueError("not a write")


@not_as_root
def test_check_writable_refuses_a_read_only_folder(tmp_path):
    with read_only_folder(tmp_path / "ro") as parent:
        with pytest.raises(OutputError, match="is not writable"):
            check_writable(parent / "a" / "b")


def test_check_writable_checks_the_nearest_existing_folder(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(
        os, "access", lambda path, mode: asked.append(str(path)) or str(path) != str(tmp_path)
    )
    with pytest.raises(OutputError) as err:
        check_writable(tmp_path / "x" / "y")
    assert asked == [str(tmp_path)]
    assert str(err.value).startswith(
        f"--out {tmp_path / 'x' / 'y'}: {tmp_path} is not writable"
    ) and "choose another --out" in str(err.value)


def test_check_writable_refuses_a_file_where_a_folder_goes(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    check_writable(notes)  # a file output (--json, a .gguf) may replace a file
    with pytest.raises(OutputError) as err:
        check_writable(notes, folder=True, flag="--out")
    assert str(err.value) == (
        f"--out {notes} is a file, not a folder — choose another --out (a new folder, or one this command wrote)"
    )
    for folder in (False, True):  # a file above the output: no folder can be made there
        with pytest.raises(OutputError, match=f"{notes} is a file, not a folder"):
            check_writable(notes / "run", folder=folder)
    check_writable(tmp_path / "new", folder=True)  # a folder, or nothing yet, is fine
    assert notes.read_text() == "mine"


# ------------------------------------------------------------------------- one writer per output
def test_lock_beside_refuses_a_second_writer_and_leaves_no_lock_file(tmp_path):
    out = tmp_path / "model.gguf"
    with lock_beside(out):
        assert "pid" in (tmp_path / ".model.gguf.lock").read_text()
        with pytest.raises(
            OutputError, match=f"another process \\(pid {os.getpid()} on .*\\) is using {out}"
        ):
            with lock_beside(out):
                pytest.fail("two writers held one output")
    assert list(tmp_path.iterdir()) == []  # the lock file goes with the lock
    with lock_beside(out):  # free again
        pass


def test_lock_beside_takes_a_fresh_lock_file_when_its_holder_deleted_the_one_it_opened(tmp_path, monkeypatch):
    """A writer that opened the lock file just before its holder deleted it must not hold that
    orphan: it takes the new file, which a third writer would find held."""
    import attn2ssm.paths as paths

    out = tmp_path / "out"
    lock = tmp_path / ".out.lock"
    real_open, opened = open, []

    def open_then_lose_it(path, mode="r", *args, **kwargs):
        fh = real_open(path, mode, *args, **kwargs)
        if path == lock and not opened:  # the holder deletes the file between our open and flock
            opened.append(path)
            lock.unlink()
        return fh

    monkeypatch.setattr(paths, "open", open_then_lose_it, raising=False)
    with lock_beside(out):
        assert opened and lock.exists()
        monkeypatch.setattr(paths, "open", real_open, raising=False)
        with pytest.raises(OutputError, match="is using"):
            with lock_beside(out):
                pass
