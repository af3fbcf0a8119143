"""``benchmarks/suite_compare.py``: students' suite tables merged by row id, by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("suite_compare.py")


def _row(rid, teacher, student, recovered):
    group = "perplexity kjv" if rid.startswith("ppl/") else "arc_easy (0-shot)"
    return {
        "id": rid,
        "group": group,
        "metric": "m",
        "teacher": teacher,
        "student": student,
        "recovered": recovered,
        "n": 4,
    }


def _write(path: Path, rows) -> str:
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_students_merge_by_row_and_later_files_win(bench, tmp_path):
    a = _write(
        tmp_path / "a.json", [_row("ppl/kjv/1024", 10.0, 12.5, 0.8), _row("task/arc_easy/0", 0.5, 0.4, 0.8)]
    )
    a2 = _write(tmp_path / "a2.json", [_row("task/arc_easy/0", 0.5, 0.45, 0.9)])
    b = _write(tmp_path / "b.json", [_row("ppl/kjv/1024", 10.0, 20.0, 0.5)])
    out = tmp_path / "cmp.json"
    assert bench.main([f"mix={a}", f"mix={a2}", f"sotu={b}", "--out", str(out), "--title", "t"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["id"] for r in rows] == ["ppl/kjv/1024", "task/arc_easy/0"]
    assert (
        rows[0]["teacher"] == 10.0
        and rows[0]["mix"]["student"] == 12.5
        and rows[0]["sotu"]["recovered"] == 0.5
    )
    # the later file won; sotu lacks the row
    assert rows[1]["mix"]["student"] == 0.45 and rows[1]["sotu"] is None
    md = out.with_suffix(".md").read_text()
    assert "| perplexity kjv | m | 4 | 10.00 | 12.50 (80 %) | 20.00 (50 %) |" in md
    assert "| arc_easy (0-shot) | m | 4 | 50.0 | 45.0 (90 %) | – |" in md
    assert out.with_suffix(".png").stat().st_size > 0


def test_teachers_that_disagree_or_missing_files_are_one_line_errors(bench, tmp_path, capsys):
    a = _write(tmp_path / "a.json", [_row("ppl/kjv/1024", 10.0, 12.5, 0.8)])
    b = _write(tmp_path / "b.json", [_row("ppl/kjv/1024", 11.0, 12.5, 0.88)])
    assert bench.main([f"a={a}", f"b={b}", "--out", str(tmp_path / "x.json")]) == 2
    assert "the teacher's ppl/kjv/1024 differs" in capsys.readouterr().err
    assert bench.main(["a=/nonexistent.json", "--out", str(tmp_path / "x.json")]) == 2
    assert "is not NAME=SUITE_JSON" in capsys.readouterr().err
