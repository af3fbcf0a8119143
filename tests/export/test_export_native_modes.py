"""``attn2ssm export --format native`` writes its folder and files with the modes the umask gives a
plain mkdir / open (as a folder written by hand would have), not the staging folder's 0700 and the
safetensors writer's 0600."""

import os
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.cli import main
from attn2ssm.student.convert import convert
from tiny_models import make_tokenizer, tiny_config


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("modes") / "student"
    config = tiny_config("llama")
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    options = {"norm": True, "norm_eps": teacher.config.rms_norm_eps}
    convert(teacher, ["mamba2", "attention"], {"mamba2": options}).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_export_s_modes_follow_the_umask(student_dir, tmp_path, umask):
    out = tmp_path / "native"
    old = os.umask(umask)
    try:
        assert main(["export", str(student_dir), "--format", "native", "--out", str(out)]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes
