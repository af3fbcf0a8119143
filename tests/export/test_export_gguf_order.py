"""``attn2ssm export --format gguf``: a student llama.cpp cannot run exactly is refused before llama.cpp
is looked for, and a converter that fails leaves its input beside --out, named in the command that
reruns it by hand (the staging folder it was in is gone)."""

import shlex
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.student.convert import convert
from tiny_models import make_tokenizer, one_line_error, tiny_config


def _student_dir(path, **options):
    config = tiny_config("llama")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    options = {"norm": True, "norm_eps": teacher.config.rms_norm_eps, **options}
    convert(teacher, ["mamba2", "mamba2"], {"mamba2": options}).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_a_student_llama_cpp_cannot_run_is_refused_before_llama_cpp_is_looked_for(
    tmp_path, capsys, monkeypatch
):
    # the private test cache holds no converter either
    monkeypatch.delenv("ATTN2SSM_LLAMA_CPP", raising=False)
    student = _student_dir(tmp_path / "student")  # the default gate has a bias
    err = one_line_error(
        capsys, ["export", str(student), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]
    )
    assert "gate_bias: true" in err and "gate_bias: false" in err and "make llama-cpp" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["student"]


FAILING_CONVERTER = "import sys\nprint('loading model', file=sys.stderr)\nprint('ValueError: boom', file=sys.stderr)\nsys.exit(1)\n"


def test_a_failed_converter_keeps_its_input_for_the_command_it_names(tmp_path, capsys, monkeypatch):
    llama = tmp_path / "llama.cpp"
    llama.mkdir()
    (llama / "convert_hf_to_gguf.py").write_text(FAILING_CONVERTER)
    monkeypatch.setenv("ATTN2SSM_LLAMA_CPP", str(llama))
    student = _student_dir(tmp_path / "student", gate_bias=False)
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    capsys.readouterr()
    from attn2ssm.cli import main

    assert main(["export", str(student), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own progress bars
    kept = out.parent / "m.llama-cpp-input"
    assert err.startswith("error: llama.cpp's convert_hf_to_gguf.py failed (exit 1): ValueError: boom"), err
    cmd = [
        sys.executable,
        str(llama / "convert_hf_to_gguf.py"),
        str(kept),
        "--outfile",
        str(out),
        "--outtype",
        "f16",
    ]
    assert err.endswith(f"run it by hand for the full log: {shlex.join(cmd)} (then delete {kept})"), err
    assert (kept / "config.json").is_file() and (kept / "model.safetensors").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == [kept.name]  # no .gguf, no staging folder


@pytest.fixture(autouse=True)
def _no_llama_cpp_runtime(monkeypatch):
    import attn2ssm.export.gguf as G

    monkeypatch.setattr(G, "_runtime_available", lambda: False)
