"""``eval`` outputs: a read-only one is refused in one line before any model loads, and a write that
fails after the scoring keeps the scores in a temporary folder, says where, and still prints the table.
(Tests run as root, which chmod does not stop: a read-only folder is os.access answering no, a failed
write an injected EROFS, as tests/test_convert_out.py does.)"""

import errno
import json
import os
from pathlib import Path

import pytest

from attn2ssm.cli import main
from attn2ssm.eval.output import KeptOutput
from read_only import deny_access
from tiny_models import one_line_error


@pytest.fixture(autouse=True)
def kept_in_tmp_path(tmp_path, monkeypatch):
    """Kept scores go to a temporary folder: here, one under the test's own tmp_path."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def _no_model_loads(monkeypatch):
    from attn2ssm.student import loading

    monkeypatch.setattr(
        loading,
        "load_model_and_tokenizer",
        lambda *a, **k: pytest.fail("a model loaded for an unwritable output"),
    )


def _erofs(path):
    return OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))


def test_kept_output_moves_once_and_says_where(tmp_path, capsys, kept_in_tmp_path):
    out, calls = KeptOutput(tmp_path / "ro" / "suite"), []

    def write(folder):
        calls.append(folder)
        if folder == tmp_path / "ro" / "suite":
            raise _erofs(folder)
        (folder / "a.txt").write_text("scores")

    kept = out.write(write)
    assert kept == out.path != tmp_path / "ro" / "suite" and (kept / "a.txt").read_text() == "scores"
    assert out.moved_from == tmp_path / "ro" / "suite" and kept.parent == kept_in_tmp_path
    err = capsys.readouterr().err
    assert (
        f"cannot write to {tmp_path / 'ro' / 'suite'} (Read-only file system); the scores are kept in {kept}"
        in err
    )
    assert out.write(write) == kept and calls[-1] == kept  # later writes go straight to the kept folder
    with pytest.raises(ValueError):  # not a write failure: raised as it is
        KeptOutput(tmp_path / "x").write(lambda p: (_ for _ in ()).throw(ValueError("bug")))
    file = KeptOutput(tmp_path / "ro" / "e.json", file=True)
    file.write(lambda p: (_ for _ in ()).throw(_erofs(p)) if p.parent.name == "ro" else p.write_text("{}"))
    assert file.path.name == "e.json" and file.path.read_text() == "{}"


def test_a_read_only_json_is_refused_before_the_model_loads(tiny_setup, tmp_path, monkeypatch, capsys):
    teacher, _ = tiny_setup
    ro = tmp_path / "ro"
    ro.mkdir()
    deny_access(monkeypatch, ro)
    _no_model_loads(monkeypatch)
    err = one_line_error(capsys, ["eval", str(teacher), "--json", str(ro / "e.json")])
    assert (
        err
        == f"error: --json {ro / 'e.json'}: {ro} is not writable (permission denied) — choose another --json, or make {ro} writable"
    )


def test_a_json_that_fails_after_scoring_keeps_the_scores(tiny_setup, tmp_path, monkeypatch, capsys):
    from attn2ssm import paths

    teacher, corpus = tiny_setup
    target = tmp_path / "e.json"
    real = paths.atomic_write_text

    def read_only_target(path, text):
        if Path(path) == target:
            raise _erofs(path)
        real(path, text)

    monkeypatch.setattr(paths, "atomic_write_text", read_only_target)
    capsys.readouterr()
    argv = ["eval", str(teacher), "--corpus", str(corpus), "--window", "32", "--max-tokens", "200"]
    assert main(argv + ["--json", str(target)]) == 0
    captured = capsys.readouterr()
    assert "held-out perplexity on" in captured.out and not target.exists()
    kept = Path(captured.err.strip().rsplit("the scores are kept in ", 1)[1])
    assert kept.name == "e.json" and json.loads(kept.read_text())["model"]["ppl"] > 1


def _suite_argv(teacher, tmp_path, *extra):
    return [
        "eval",
        str(teacher),
        "--suite",
        "standard",
        "--rows",
        "perplexity",
        "--against",
        str(teacher),
    ] + [
        "--suite-cache",
        str(tmp_path / "cache"),
        *extra,
    ]


def test_a_read_only_suite_folder_is_refused_before_scoring(
    tiny_setup, tiny_suite, tmp_path, monkeypatch, capsys
):
    teacher, corpus = tiny_setup
    tiny_suite([corpus])
    ro = tmp_path / "ro"
    ro.mkdir()
    deny_access(monkeypatch, ro)
    _no_model_loads(monkeypatch)
    err = one_line_error(capsys, _suite_argv(teacher, tmp_path, "--out", str(ro / "suite")))
    assert err.startswith(f"error: --out {ro / 'suite'}: {ro} is not writable")


def test_a_suite_whose_folder_fails_after_scoring_prints_and_keeps_its_table(
    tiny_setup, tiny_suite, tmp_path, monkeypatch, capsys
):
    from attn2ssm.eval import suite

    teacher, corpus = tiny_setup
    tiny_suite([corpus])
    out = tmp_path / "suite"
    real = suite.write_suite_report

    def turned_read_only(report, folder):
        if Path(folder) == out:
            raise _erofs(out / "suite.json")
        real(report, folder)

    monkeypatch.setattr(suite, "write_suite_report", turned_read_only)
    capsys.readouterr()
    assert main(_suite_argv(teacher, tmp_path, "--out", str(out))) == 0
    captured = capsys.readouterr()
    kept = Path(captured.err.strip().splitlines()[-1].rsplit("the scores are kept in ", 1)[1])
    assert (
        f"| perplexity {corpus} | ppl @32 |" in captured.out and f"wrote {kept / 'suite.md'}" in captured.out
    )
    assert json.loads((kept / "suite.json").read_text())["rows"][0]["id"] == f"ppl/{corpus}/32"
    assert not out.exists()


def test_suite_windows_past_the_models_positions_say_lower_windows(
    tiny_setup, tiny_suite, tmp_path, monkeypatch, capsys
):
    """A window the user chose past a model's positions is refused in one line; one of the suite's own
    is skipped with a note, and the rest is scored."""
    teacher, corpus = tiny_setup  # 128 positions
    tiny_suite([corpus], windows=(32, 256))
    argv = _suite_argv(teacher, tmp_path, "--out", str(tmp_path / "s"))
    err = one_line_error(capsys, [*argv, "--windows", "32,256"])
    assert err.endswith(
        "reads at most 128 positions, and the suite needs 256 — lower --windows to 128 or less, e.g. --windows 128"
    )
    assert "and --curve-windows" in one_line_error(
        capsys, [*argv, "--windows", "256", "--curve-windows", "32,256"]
    )
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"note: {teacher} reads at most 128 positions: windows 256 skipped" in captured.err
    rows = json.loads((tmp_path / "s" / "suite.json").read_text())["rows"]
    assert [r["id"] for r in rows] == [f"ppl/{corpus}/32"]
    tiny_suite([corpus], windows=(256, 512))  # nothing left to score: refused
    assert "lower --windows to 128" in one_line_error(capsys, argv)


def test_a_read_only_model_folder_refuses_tasks_before_scoring(tiny_setup, tmp_path, monkeypatch, capsys):
    from attn2ssm.eval import harness

    teacher, _ = tiny_setup
    monkeypatch.setattr(
        harness, "run_lm_eval", lambda *a, **k: pytest.fail("scored for an unwritable output")
    )
    deny_access(monkeypatch, teacher)
    err = one_line_error(capsys, ["eval", str(teacher), "--tasks", "piqa", "--limit", "2"])
    assert err.startswith(f"error: --json {teacher / 'eval' / 'lm_eval.json'}: {teacher} is not writable")


def test_tasks_whose_json_fails_after_scoring_keep_the_results(tiny_setup, tmp_path, monkeypatch, capsys):
    from attn2ssm.eval import harness

    pytest.importorskip("lm_eval", reason="needs lm_eval (pip install -e '.[eval]')")
    teacher, _ = tiny_setup
    record = {"results": {"piqa": {"acc,none": 0.5, "acc_stderr,none": 0.1}}, "versions": {"piqa": 1}}
    monkeypatch.setattr(harness, "run_lm_eval", lambda *a, **k: record)
    monkeypatch.setattr(harness, "results_table", lambda record: "| piqa | 0.5 |")
    target = tmp_path / "ro" / "e.json"
    real = harness.write_results

    def read_only(rec, path):
        if Path(path) == target:
            raise _erofs(path)
        return real(rec, path)

    monkeypatch.setattr(harness, "write_results", read_only)
    capsys.readouterr()
    assert main(["eval", str(teacher), "--tasks", "piqa", "--json", str(target)]) == 0
    captured = capsys.readouterr()
    kept = Path(captured.out.strip().splitlines()[-1].removeprefix("results: "))
    assert "| piqa | 0.5 |" in captured.out and kept != target and kept.name == "e.json"
    assert json.loads(kept.read_text())["results"]["piqa"]["acc,none"] == 0.5
    assert f"the scores are kept in {kept}" in captured.err
