"""``attn2ssm convert --out`` (in-process CLI): a directory that already holds a model or a run is
not overwritten without ``--force``, and with it the new student replaces the old one only once it
is completely written."""

import hashlib
import json

import pytest
import torch
from tiny_models import make_tokenizer, tiny_config
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    tok = make_tokenizer()
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _digest(directory) -> dict:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


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
