"""``ATTN2SSM_KERNELS`` outside ``distill``: eval, generate and export check it before a model loads, and
a model built or run with a setting that cannot hold is refused in one line, never a traceback."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from attn2ssm.errors import ConfigError
from attn2ssm.ops import kernels
from attn2ssm.student.convert import convert
from attn2ssm.student.plans import make_plan
from tiny_models import make_tokenizer, one_line_error, tiny_config


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels_env") / "student"
    tok = make_tokenizer()
    cfg = tiny_config("llama")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    convert(
        AutoModelForCausalLM.from_config(cfg).eval(), make_plan(cfg.num_hidden_layers, "linear_attention")
    ).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def on_a_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kernels, "fla_problem", lambda: None)  # as if fla imported: the CPU alone refuses it


COMMANDS = {
    "generate": ["generate", "STUDENT", "--prompt", "hi", "--max-new-tokens", "2"],
    "eval": ["eval", "STUDENT", "--corpus", "sotu", "--window", "16", "--max-tokens", "64"],
    "export": ["export", "STUDENT", "--format", "native", "--out", "OUT"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    ("value", "needles"),
    [
        ("fla", ["ATTN2SSM_KERNELS=fla runs Triton kernels on CUDA", "unset ATTN2SSM_KERNELS"]),
        ("bogus", ["ATTN2SSM_KERNELS='bogus' is not a kernel choice", "use one of: auto, torch, fla"]),
    ],
)
def test_a_kernel_setting_that_cannot_hold_is_one_line(
    student_dir, tmp_path, capsys, monkeypatch, on_a_cpu, command, value, needles
):
    monkeypatch.setenv("ATTN2SSM_KERNELS", value)
    argv = [{"STUDENT": str(student_dir), "OUT": str(tmp_path / "out")}.get(a, a) for a in COMMANDS[command]]
    err = one_line_error(capsys, argv)
    assert all(n in err for n in needles), err
    assert not (tmp_path / "out").exists()


def test_a_model_built_or_run_with_such_a_setting_is_one_line(monkeypatch, on_a_cpu):
    """Where no command checked first (a Python user's own load): a mixer built under a name that is no
    kernel choice, or fla asked for a CPU tensor, is a ConfigError naming the fix."""
    from attn2ssm.mixers.base import MixerContext

    monkeypatch.setenv("ATTN2SSM_KERNELS", "bogus")
    with pytest.raises(ConfigError, match="ATTN2SSM_KERNELS='bogus' is not a kernel choice"):
        MixerContext()
    with pytest.raises(
        ConfigError, match=r"fla cannot run .* \(unset ATTN2SSM_KERNELS or set it to auto or torch\)"
    ):
        kernels.resolve_backend("fla", torch.zeros(2))
