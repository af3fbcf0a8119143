"""Issue 46: one export at a time per ``--out``. An export holds its output (``paths.lock_beside``)
from its checks to its last write, so a second export into the same ``--out`` at the same time is
refused in one line instead of both reporting "wrote"; the lock file goes with it."""

import pytest

import attn2ssm.export.gguf as gguf
import attn2ssm.export.native as native
from attn2ssm.errors import OutputError
from attn2ssm.export.native import export_native
from attn2ssm.paths import lock_beside
from attn2ssm.student.convert import convert
from tiny_models import make_tokenizer, one_line_error, save_tiny_teacher


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    """A tiny pure Mamba-2 student both maps take (norm on, no gate bias), saved with its tokenizer."""
    path = tmp_path_factory.mktemp("student")
    teacher = save_tiny_teacher(tmp_path_factory.mktemp("teacher"))
    cfg = teacher.config
    mamba2 = {"norm": True, "norm_eps": cfg.rms_norm_eps, "gate": True, "gate_bias": False}
    convert(teacher, ["mamba2"] * cfg.num_hidden_layers, {"mamba2": mamba2}).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_a_second_native_export_while_one_writes_is_refused(student_dir, tmp_path, monkeypatch):
    out = tmp_path / "native"
    real_write, second = native._write_native, []

    def and_a_second_export_meanwhile(*args, **kwargs):
        with pytest.raises(OutputError, match=f"another process .* is using {out}"):
            export_native(student_dir, out, force=True)
        second.append("refused")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(native, "_write_native", and_a_second_export_meanwhile)
    result = export_native(student_dir, out)
    assert second == ["refused"] and result.out == out and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native"]  # no lock file or staging left


def test_the_cli_refuses_an_export_into_a_held_out(student_dir, tmp_path, capsys):
    out = tmp_path / "native"
    argv = ["export", str(student_dir), "--format", "native", "--out", str(out)]
    with lock_beside(out):  # as a first export still writing there holds it
        err = one_line_error(capsys, argv)
    assert f"is using {out}" in err and "wait for it to finish" in err, err
    assert not out.exists()  # the second wrote nothing
    from attn2ssm.cli import main

    assert main(argv) == 0 and (out / "config.json").is_file()  # once the first is done
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native"]


def test_a_gguf_export_into_a_held_out_is_refused_before_any_work(student_dir, tmp_path, monkeypatch):
    out = tmp_path / "student.gguf"
    monkeypatch.setattr(gguf, "converter_dir", lambda: tmp_path)  # as if llama.cpp were installed
    monkeypatch.setattr(gguf, "_convert", lambda *a, **k: pytest.fail("a held --out was written"))
    with lock_beside(out):
        with pytest.raises(OutputError, match=f"is using {out}"):
            gguf.export_gguf(student_dir, out, outtype="f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
