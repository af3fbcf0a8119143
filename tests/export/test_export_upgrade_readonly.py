"""``attn2ssm upgrade`` on a folder it cannot write: one line before anything is written (every DIR is
checked before the first is touched), and a write the OS refuses half-way is one line that leaves the
checkpoint as it was. Tests run as root, where chmod stops nothing: os.access and the write are faked."""

import errno
import os

import pytest

import attn2ssm.export.upgrade as upgrade
from read_only import deny_access
from tiny_models import one_line_error, tiny_student


@pytest.fixture
def students(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "ro"]
    for d in dirs:
        tiny_student("llama", "linear_attention").save_pretrained(d)
    return dirs


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_read_only_student_folder_is_one_line_before_any_folder_is_written(students, capsys, monkeypatch):
    writable, ro = students
    before = {d: _snapshot(d) for d in students}
    deny_access(monkeypatch, ro)
    err = one_line_error(capsys, ["upgrade", str(writable), str(ro)])
    assert err == (
        f"error: DIR {ro}: {ro} is not writable (permission denied) — make {ro} writable, "
        "then run attn2ssm upgrade again (the checkpoint still loads as it was)"
    )
    assert {d: _snapshot(d) for d in students} == before  # the writable one was not upgraded either


def test_a_write_refused_half_way_is_one_line_and_leaves_the_checkpoint(students, capsys, monkeypatch):
    _, ro = students
    before = _snapshot(ro)

    def read_only(folder):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(folder / "attn2ssm_errors.py"))

    monkeypatch.setattr(upgrade, "write_remote_code", read_only)
    err = one_line_error(capsys, ["upgrade", str(ro)])
    assert err == (
        f"error: cannot write the refreshed modeling code to {ro}: Read-only file system — make {ro} writable, "
        "then run attn2ssm upgrade again (the checkpoint still loads as it was)"
    )
    assert _snapshot(ro) == before  # no staging folder left, config.json as it was
