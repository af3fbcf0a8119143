"""The teacher's GGUF across the device calls (benchmarks/gpu/teacher_parts.py): split here into
parts with their SHA-256 sums, one part carried by each call, kept on the machine by ``unpack``,
joined by the last call into the attn2ssm cache byte for byte; a damaged part or a call that did
not run stops with one line naming the fix."""

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import teacher_parts as gpu  # noqa: E402

MIB = 1 << 20


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    """A fake GGUF (random bytes: xz cannot shrink them, so every part is real) in a repo root."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "src" / gpu.GGUF
    path.parent.mkdir()
    path.write_bytes(os.urandom(300_000))
    return path


def _carry(here: Path, part: int) -> None:
    """What the device has in .gpu_train/ during the call that carries part ``part``."""
    shutil.rmtree(".gpu_train", ignore_errors=True)
    shutil.copytree(here / f"part{part}", Path(".gpu_train") / f"part{part}")


def test_three_parts_travel_in_three_calls_and_join_into_the_gguf(gguf, tmp_path):
    here = tmp_path / "prepared"
    gpu.split_teacher(gguf, here, [0.1, 0.1])
    sizes = [(here / f"part{i}" / f"{gpu.GGUF}.xz.part{i - 1}").stat().st_size for i in (1, 2, 3)]
    assert sizes[:2] == [int(0.1 * MIB)] * 2 and sum(sizes) == (here / f"{gpu.GGUF}.xz").stat().st_size
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    for part in (1, 2):  # the calls before the last: unpack keeps each
        _carry(here, part)
        assert gpu.keep_parts(work) == [part]
    _carry(here, 3)
    joined = gpu.join_gguf(work, cache)  # the last call (then converted as smollm2-135m resolves: not here)
    assert joined == cache / "teachers" / "smollm2-135m" / gpu.GGUF
    assert joined.read_bytes() == gguf.read_bytes()


def test_a_damaged_part_or_a_call_that_did_not_run_is_one_line(gguf, tmp_path):
    here, work, cache = tmp_path / "prepared", tmp_path / "work", tmp_path / "cache"
    gpu.split_teacher(gguf, here, [0.1])
    work.mkdir()
    _carry(here, 2)  # the last call without the first
    with pytest.raises(
        SystemExit, match="GGUF part 1 is missing: the call carrying .gpu_train/part1 did not run"
    ):
        gpu.join_gguf(work, cache)
    _carry(here, 1)
    carried = Path(".gpu_train/part1") / f"{gpu.GGUF}.xz.part0"
    carried.write_bytes(bytes([carried.read_bytes()[0] ^ 1]) + carried.read_bytes()[1:])
    with pytest.raises(SystemExit, match="GGUF part 1 is damaged"):
        gpu.keep_parts(work)
