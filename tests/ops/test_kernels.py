"""The kernels' dispatch (ops/kernels.py): what ``auto`` / ``torch`` / ``fla`` resolve to, refusals,
the environment override, and that the chunked forms follow it."""

import pytest
import torch

from attn2ssm.errors import ConfigError
from attn2ssm.ops import kernels
from attn2ssm.ops.kernels import choose_kernels, resolve_backend


@pytest.fixture
def fla(monkeypatch):
    """A function (problem or None) → fla's import made to fail or succeed, without importing it."""
    monkeypatch.delenv("ATTN2SSM_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def install(problem):
        monkeypatch.setattr(kernels, "fla_problem", lambda: problem)

    return install


def test_cpu_runs_the_pytorch_forms_and_refuses_fla(fla):
    fla(None)
    assert choose_kernels("auto", "cpu").used == "torch"
    assert choose_kernels("torch", "cpu").used == "torch"
    with pytest.raises(ConfigError, match="runs Triton kernels on CUDA"):
        choose_kernels("fla", "cpu")


def test_cuda_takes_fla_where_it_imports(fla):
    fla(None)
    assert choose_kernels("auto", "cuda").used == "fla"
    assert choose_kernels("fla", "cuda").used == "fla"
    assert choose_kernels("torch", "cuda").used == "torch"
    fla("fla does not import (ModuleNotFoundError: no fla)")
    choice = choose_kernels("auto", "cuda")
    assert choice.used == "torch" and "does not import" in choice.reason
    with pytest.raises(ConfigError, match=r"attn2ssm\[gpu\]"):
        choose_kernels("fla", "cuda")


def test_the_environment_wins_and_bad_names_are_one_line(fla, monkeypatch):
    fla(None)
    monkeypatch.setenv("ATTN2SSM_KERNELS", "torch")
    assert choose_kernels("fla", "cuda").used == "torch"
    monkeypatch.setenv("ATTN2SSM_KERNELS", "triton")
    with pytest.raises(ConfigError, match="ATTN2SSM_KERNELS='triton' is not a kernel choice"):
        choose_kernels("auto", "cpu")
    monkeypatch.delenv("ATTN2SSM_KERNELS")
    with pytest.raises(ConfigError, match="use one of: auto, torch, fla"):
        choose_kernels("cuda", "cpu")


def test_resolve_backend_per_tensor(fla):
    fla(None)
    x = torch.zeros(2)
    assert resolve_backend("auto", x) == "torch" and resolve_backend("torch", x) == "torch"  # a CPU tensor
    with pytest.raises(RuntimeError, match="cannot run"):
        resolve_backend("fla", x)
    with pytest.raises(ValueError):
        resolve_backend("cuda", x)


def test_the_recipe_takes_kernels_and_checks_the_device():
    from attn2ssm.distill.recipe import load_recipe

    assert load_recipe("quickstart").kernels == "auto"
    assert load_recipe("quickstart", ["kernels=torch"]).kernels == "torch"
    with pytest.raises(ConfigError, match="not a kernel choice"):
        load_recipe("quickstart", ["kernels=triton"])
    with pytest.raises(ConfigError, match="is not a device"):
        load_recipe("quickstart", ["device=gpu0"])
    assert load_recipe("quickstart", ["device=cuda:1"]).device == "cuda:1"


def test_a_named_gpu_that_is_not_there_is_one_line(monkeypatch):
    from attn2ssm.distill.trainer import _select_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="this machine has no CUDA devices"):
        _select_gpu("cuda:1")
    _select_gpu("cuda")  # nothing to select
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="several processes"):
        _select_gpu("cuda:0")


def test_students_built_inside_building_with_start_with_its_kernels(monkeypatch):
    from attn2ssm.mixers.base import MixerContext

    monkeypatch.delenv("ATTN2SSM_KERNELS", raising=False)
    assert MixerContext().kernels == "auto"
    with kernels.building_with("torch"):
        assert MixerContext().kernels == "torch"
        with kernels.building_with("fla"):
            assert MixerContext().kernels == "fla"
        assert MixerContext().kernels == "torch"
    monkeypatch.setenv("ATTN2SSM_KERNELS", "torch")
    assert MixerContext().kernels == "torch"  # outside a run the environment is the default
    with pytest.raises(ConfigError, match="not a kernel choice"):
        with kernels.building_with("cuda"):
            pass
    assert kernels.default_kernels() == "torch"  # a refused name leaves nothing behind


def test_a_run_s_kernels_hold_from_its_first_forward(run_overrides, tmp_path, monkeypatch):
    """kernels: torch reaches the forwards a run makes before training — automatic layer selection's
    probes, decay calibration, a stepwise stage's grown student — not only the training steps (on a
    GPU those forwards ran fla's kernels under kernels: torch, the default "auto" of a new student)."""
    import attn2ssm.ops.gated_delta as gated_delta_ops
    from attn2ssm.distill.recipe import load_recipe
    from attn2ssm.distill.trainer import distill
    from tiny_models import BASE_RECIPE

    monkeypatch.delenv("ATTN2SSM_KERNELS", raising=False)
    asked: list[str] = []
    real = gated_delta_ops.resolve_backend
    monkeypatch.setattr(gated_delta_ops, "resolve_backend", lambda b, t: asked.append(b) or real(b, t))
    stage = "{name: %s, kind: kd, tokens: 256, batch_size: 4, save_every: 1, optim: {lr: 0.01}%s}"
    overrides = run_overrides(
        **{
            "stages": "[" + stage % ("half", "") + ", " + stage % ("none", ", attention_ratio: 0.0") + "]",
            "student.mixer": "gated_delta",
            "student.mixer_options": "{}",
            "student.attention_ratio": 0.5,
            "student.keep_attention": "auto",
            "kernels": "torch",
        }
    )
    distill(load_recipe(BASE_RECIPE, overrides), tmp_path / "run", progress=False)
    assert len(asked) > 4 and set(asked) == {"torch"}


def test_fla_operands_meet_in_one_dtype():
    """The fla adapters' operands: autocast's dtype where autocast is on (the H200 run's case: fp32
    keys beside bf16 values), else the widest of theirs; nothing here imports fla."""
    from attn2ssm.ops.fla import _one_dtype

    q, v = torch.ones(2, dtype=torch.float32), torch.ones(2, dtype=torch.bfloat16)
    assert [t.dtype for t in _one_dtype(q, v)] == [torch.float32, torch.float32]
    assert [t.dtype for t in _one_dtype(v, v.half())] == [torch.float32, torch.float32]  # bf16 + fp16: fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [t.dtype for t in _one_dtype(q, v)] == [torch.bfloat16, torch.bfloat16]
