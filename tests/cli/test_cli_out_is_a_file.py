"""Issue 46: an output folder flag naming an existing file is one line (``paths.check_writable``
with ``folder``), from every command that writes a folder: convert, data shards, export (native),
eval --out and distill; the file is left as it was and nothing is written beside it."""

import pytest

from attn2ssm.student.convert import convert
from tiny_models import make_tokenizer, one_line_error, save_tiny_teacher


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama teacher and its pure Mamba-2 student (exportable: norm on), both saved."""
    root = tmp_path_factory.mktemp("models")
    teacher = save_tiny_teacher(root / "teacher")
    cfg = teacher.config
    plan = ["mamba2"] * cfg.num_hidden_layers
    student = convert(teacher, plan, {"mamba2": {"norm": True, "norm_eps": cfg.rms_norm_eps}})
    student.save_pretrained(root / "student")
    make_tokenizer().save_pretrained(root / "student")
    return root


COMMANDS = {
    "convert": ["convert", "--teacher", "TEACHER", "--out", "OUT"],
    "data shards": ["data", "shards", "sotu", "--teacher", "TEACHER", "--out", "OUT"],
    "export": ["export", "STUDENT", "--format", "native", "--out", "OUT"],
    "eval --out": ["eval", "STUDENT", "--report", "--out", "OUT"],
    "distill --resume": ["distill", "--out", "OUT", "--resume"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_out_naming_a_file_is_one_line(models, tmp_path, capsys, command):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    names = {"TEACHER": models / "teacher", "STUDENT": models / "student", "OUT": target}
    err = one_line_error(capsys, [str(names.get(a, a)) for a in COMMANDS[command]])
    assert f"--out {target} is a file, not a folder" in err, err
    assert target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing staged beside it
