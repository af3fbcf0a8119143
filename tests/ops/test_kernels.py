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
