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
    with pytest.raises(ConfigError, match="cannot run"):
        resolve_backend("fla", x)
    with pytest.raises(ConfigError, match="not a kernel choice"):
        resolve_backend("cuda", x)


@pytest.mark.parametrize(
    ("capability", "triton", "tilelang", "wrong"),
    [
        ((9, 0), (3, 6, 0), False, True),  # the H200 run's machine: fla refused the backward
        ((9, 0), (3, 4, 0), False, True),
        ((9, 0), (3, 7, 0), False, True),
        ((9, 0), (3, 7, 1), False, False),  # fixed Triton
        ((9, 0), (3, 3, 1), False, False),  # before the fault
        ((9, 0), (3, 6, 0), True, False),  # fla's TileLang backend takes the function
        ((8, 0), (3, 6, 0), False, False),  # an A100
        ((10, 0), (3, 6, 0), False, False),  # a Blackwell
    ],
)
def test_fla_gated_backward_problem_follows_fla_s_guard(monkeypatch, capability, triton, tilelang, wrong):
    monkeypatch.setattr(kernels, "_GATED_CHECKED", {})
    monkeypatch.setattr(kernels, "_capability", lambda device: capability)
    monkeypatch.setattr(kernels, "_triton_version", lambda: triton)
    monkeypatch.setattr(kernels, "_tilelang_ready", lambda: tilelang)
    problem = kernels.fla_gated_backward_problem(torch.device("cuda", 0))
    if wrong:
        assert "fla issue #640" in problem and "triton>=3.7.1 or tilelang" in problem
        assert ".".join(map(str, triton)) in problem
    else:
        assert problem is None
    assert kernels.fla_gated_backward_problem(torch.device("cpu")) is None  # the interpreter's case


def test_a_wrong_gated_backward_sends_training_to_the_pytorch_forms(fla, monkeypatch):
    """Where fla's gated backward is known wrong, a call that will be differentiated runs the PyTorch
    form (``fla`` asked or ``auto``), with a warning; inference and ungated calls keep fla."""
    fla(None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fla counts as usable on this CPU tensor
    monkeypatch.setattr(kernels, "_WARNED", set())
    x = torch.zeros(2)
    assert resolve_backend("fla", x, gated_backward=True) == "fla"  # no known fault
    monkeypatch.setattr(
        kernels, "fla_gated_backward_problem", lambda device, *a: "fla's gated chunk backward is wrong"
    )
    with pytest.warns(
        RuntimeWarning, match="train with the PyTorch form: fla's gated chunk backward is wrong"
    ):
        assert resolve_backend("fla", x, gated_backward=True) == "torch"
    assert resolve_backend("auto", x, gated_backward=True) == "torch"
    assert resolve_backend("fla", x) == "fla" and resolve_backend("auto", x, gated_backward=False) == "fla"
    leaf = torch.zeros(2, requires_grad=True)
    assert kernels.needs_backward(x, None, leaf) and not kernels.needs_backward(x, None)
    with torch.no_grad():
        assert not kernels.needs_backward(leaf)


@pytest.mark.parametrize("op", ["gated_delta", "ssd"])
def test_the_gated_forms_ask_for_a_safe_backward_only_when_training(fla, monkeypatch, op):
    """gated_delta_chunked and ssd_chunked tell the dispatch whether they will be differentiated: with
    the gated backward known wrong, a training SSD call runs the PyTorch form, a training gated
    delta rule call fla's padded path, a no-grad call fla's."""
    import attn2ssm.ops.fla as fla_ops
    from attn2ssm.ops.gated_delta import gated_delta_chunked
    from attn2ssm.ops.ssd import ssd_chunked

    fla(None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "fla_gated_backward_problem", lambda device, *a: "wrong here")
    called = []
    monkeypatch.setattr(fla_ops, f"{op}_fla", lambda *a, **kw: called.append(op) or ("fla", None))
    torch.manual_seed(0)
    b, l, h, d = 1, 12, 2, 4
    if op == "gated_delta":
        q, k = (torch.nn.functional.normalize(torch.randn(b, l, h, d), dim=-1) for _ in range(2))
        v, g, beta = torch.randn(b, l, h, d), -torch.rand(b, l, h), torch.rand(b, l, h)
        args = (q, k, v, g, beta)
        run = lambda *t: gated_delta_chunked(*t, chunk_size=4, backend="fla")  # noqa: E731
    else:
        args = (
            torch.randn(b, l, h, d),
            -torch.rand(b, l, h),
            torch.randn(b, l, h, 3),
            torch.randn(b, l, h, 3),
        )
        run = lambda *t: ssd_chunked(*t, chunk_size=4, backend="fla")  # noqa: E731
    with torch.no_grad():
        assert run(*args)[0] == "fla" and called == [op]
    trained = [t.clone().requires_grad_(i == 2) for i, t in enumerate(args)]
    if op == "gated_delta":  # fla still trains it: its adapter pads d_k to 128 (tests/kernels)
        assert run(*trained)[0] == "fla" and called == [op, op]
        return
    with pytest.warns(RuntimeWarning, match="wrong here"):
        monkeypatch.setattr(kernels, "_WARNED", set())
        out, _ = run(*trained)
    assert called == [op] and out.requires_grad  # the PyTorch form ran, and it trains
    torch.testing.assert_close(out, ssd_chunked(*trained, backend="torch")[0], rtol=1e-5, atol=1e-5)


def test_a_run_records_fla_s_gated_backward_fault(fla, monkeypatch):
    fla(None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(kernels, "fla_gated_backward_problem", lambda device, *a: "wrong here")
    for requested in ("auto", "fla"):
        choice = choose_kernels(requested, "cuda")
        assert choice.used == "fla" and choice.reason.endswith(
            "the gated delta rule trains through fla with d_k padded to 128, SSD with the PyTorch form: wrong here"
        )
    monkeypatch.setattr(kernels, "fla_gated_backward_problem", lambda device, *a: None)
    assert choose_kernels("auto", "cuda").reason == "fla's Triton kernels import"


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
    from attn2ssm.distill.accelerator import _select_gpu

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
    monkeypatch.setattr(
        gated_delta_ops, "resolve_backend", lambda b, t, **kw: asked.append(b) or real(b, t, **kw)
    )
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
