"""The teacher's GGUF across the two device calls (benchmarks/gpu/distill_on_gpu.py): split here into
two parts with their SHA-256 sums, part 1 kept by call 1, joined by call 2 into the attn2ssm cache
byte for byte; a damaged part or a missing call 1 stops with one line naming the fix."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import distill_on_gpu as gpu  # noqa: E402


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """A fake GGUF (random bytes: xz cannot shrink them, so both parts are real) split in a repo root."""
    monkeypatch.chdir(tmp_path)
    gguf = tmp_path / "src" / gpu.GGUF
    gguf.parent.mkdir()
    gguf.write_bytes(os.urandom(300_000))
    gpu.split_teacher(gguf, Path(".gpu_train"), part1_mib=0.1)
    return gguf, tmp_path / "work", tmp_path / "cache"


def test_the_parts_join_into_the_gguf_where_the_teacher_is_looked_for(parts):
    gguf, work, cache = parts
    assert (Path(".gpu_train/part1") / f"{gpu.GGUF}.xz.part0").stat().st_size == int(0.1 * (1 << 20))
    work.mkdir()
    gpu.keep_part1(work)  # call 1
    joined = gpu.join_gguf(work, cache)  # call 2 (then converted as smollm2-135m resolves: not here)
    assert joined == cache / "teachers" / "smollm2-135m" / gpu.GGUF
    assert joined.read_bytes() == gguf.read_bytes()


def test_a_damaged_part_or_a_missing_call_1_is_one_line(parts):
    _, work, cache = parts
    work.mkdir()
    with pytest.raises(SystemExit, match="GGUF part 1 is missing: call 1 did not run"):
        gpu.join_gguf(work, cache)
    gpu.keep_part1(work)
    part = next(Path(".gpu_train/part2").glob("*.part1"))
    part.write_bytes(part.read_bytes()[:-1] + bytes([part.read_bytes()[-1] ^ 1]))
    with pytest.raises(SystemExit, match="GGUF part 2 is damaged"):
        gpu.join_gguf(work, cache)
    carried = Path(".gpu_train/part1") / f"{gpu.GGUF}.xz.part0"
    carried.write_bytes(bytes([carried.read_bytes()[0] ^ 1]) + carried.read_bytes()[1:])
    with pytest.raises(SystemExit, match="GGUF part 1 is damaged"):
        gpu.keep_part1(work)
