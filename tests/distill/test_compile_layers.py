"""The ``compile_layers`` stage option: each decoder layer ``torch.compile``d in place gives the eager
student's loss and gradients (alone and under activation checkpointing), a two-stage run trains as
the eager one, the option is undone at the stage end, is type-checked and refused where the student's forward does not run, and a device where
``torch.compile`` does not work is refused in one line before training.

Most tests trace with dynamo + AOT autograd and run the traced graphs eagerly (``aot_eager``:
seconds); one compiles with inductor (the backend runs get), marked slow (minutes on a busy CPU)."""

import pytest
import torch

from attn2ssm.distill import stage_setup
from attn2ssm.distill.losses import response_cross_entropy
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.stage_setup import (
    activation_checkpointing,
    check_compile,
    compiled_layers,
    decoder_layers,
)
from attn2ssm.errors import ConfigError
from tiny_models import BASE_RECIPE, tiny_student


def _loss_and_grads(student, ids, mask) -> tuple[torch.Tensor, dict]:
    student.zero_grad(set_to_none=True)
    logits = student(input_ids=ids, attention_mask=mask, use_cache=False).logits
    total, count = response_cross_entropy(logits, ids, mask)
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


def _agree(backend: str, monkeypatch, checkpointed: bool) -> None:
    torch._dynamo.reset()
    monkeypatch.setattr(stage_setup, "COMPILE_BACKEND", backend)
    torch.manual_seed(0)
    student = tiny_student("llama", "mamba2", ratio=0.5).train()  # one mixer layer, one kept attention
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding, as sft / dpo batches
    eager_loss, eager = _loss_and_grads(student, ids, mask)
    if checkpointed:
        activation_checkpointing(student, True)
    compiled_layers(student, True)
    layers = decoder_layers(student)
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    state_names = set(student.state_dict())
    loss, grads = _loss_and_grads(student, ids, mask)
    assert set(student.state_dict()) == state_names  # compiled in place: checkpoints keep their names
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == eager.keys() and len(grads) > 10
    for name in eager:
        torch.testing.assert_close(grads[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)
    compiled_layers(student, False)  # the stage end
    assert all(layer._compiled_call_impl is None for layer in layers)
    torch._dynamo.reset()


class CountingBackend:
    """aot_eager that counts the graphs dynamo hands it (so the test sees the layers were traced)."""

    def __init__(self):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs, self._aot_eager = 0, aot_eager

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return self._aot_eager(graph_module, example_inputs)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "with_gradient_checkpointing"])
def test_compiled_layers_give_the_eager_loss_and_gradients(monkeypatch, checkpointed):
    # the attention layer and the mixer layer share their forward's code: at dynamo's limit of one
    # graph a code, the second layer would run eagerly unless compiled_layers raises it
    backend = CountingBackend()
    with torch._dynamo.config.patch(recompile_limit=1):
        _agree(backend, monkeypatch, checkpointed)
    assert backend.graphs >= 2  # each of the two layers traced (more where a mixer breaks its graph)


@pytest.mark.slow
def test_inductor_compiled_layers_give_the_eager_loss_and_gradients(monkeypatch):
    _agree("inductor", monkeypatch, checkpointed=True)


def test_compile_layers_is_type_checked_and_off_by_default():
    recipe = load_recipe(BASE_RECIPE, [])
    assert not any(stage.compile_layers for stage in recipe.stages)
    on = load_recipe(BASE_RECIPE, ["stages.1.compile_layers=true", "stages.1.gradient_checkpointing=true"])
    assert on.stages[1].compile_layers is True and on.stages[1].gradient_checkpointing is True
    with pytest.raises(ConfigError) as err:  # the schema's types (recipe_schema.py)
        load_recipe(BASE_RECIPE, ["stages.1.compile_layers=yes please"])
    text = str(err.value)
    assert "stages[1].compile_layers must be bool" in text and "\n" not in text


def test_compile_layers_on_a_layer_local_kind_is_refused():
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE_RECIPE, ["stages.0.compile_layers=true"])  # attention_transfer
    text = str(err.value)
    assert "compile_layers" in text and "remove stages.0.compile_layers" in text and "\n" not in text


def test_a_device_where_compile_fails_is_refused_in_one_line(monkeypatch):
    recipe = load_recipe(BASE_RECIPE, ["stages.1.compile_layers=true"])

    def broken(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(ConfigError) as err:
        check_compile(recipe.stages, torch.device("cpu"))
    text = str(err.value)
    assert "stages.1.compile_layers" in text and "No working C++ compiler" in text
    assert "set stages.1.compile_layers: false" in text and "\n" not in text
    check_compile(load_recipe(BASE_RECIPE, []).stages, torch.device("cpu"))  # off: nothing is compiled


def test_a_working_compile_passes_the_check(monkeypatch):
    recipe = load_recipe(BASE_RECIPE, ["stages.1.compile_layers=true"])
    backend = CountingBackend()
    monkeypatch.setattr(stage_setup, "COMPILE_BACKEND", backend)
    check_compile(recipe.stages, torch.device("cpu"))
    assert backend.graphs == 1  # the probe was compiled and ran


def test_a_run_with_compile_layers_where_compile_fails_stops_before_it_writes(monkeypatch, tmp_path):
    from attn2ssm.distill.trainer import Distiller
    from tiny_models import tiny_model

    def broken(*args, **kwargs):
        raise RuntimeError("No working C++ compiler found")

    recipe = load_recipe(BASE_RECIPE, ["device=cpu", "data.block_len=64", "stages.1.compile_layers=true"])
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(ConfigError, match=r"set stages\.1\.compile_layers: false"):
        Distiller(recipe, tmp_path / "run", teacher=tiny_model("llama"))
    assert not (tmp_path / "run").exists()


def _stages(on: str) -> str:
    return (
        f"[{{name: kd, kind: kd, tokens: 768, batch_size: 4, trainable: [all], compile_layers: {on}, optim: {{lr: 0.01}}}},"
        f" {{name: ce, kind: ce, tokens: 384, batch_size: 4, trainable: [lora, mixers], lora: {{r: 4, alpha: 8}},"
        f" compile_layers: {on}, gradient_checkpointing: true}}]"
    )


def test_a_run_with_compiled_layers_trains_as_the_eager_one(run_overrides, tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file

    from attn2ssm.distill.trainer import distill

    backend = CountingBackend()
    monkeypatch.setattr(stage_setup, "COMPILE_BACKEND", backend)
    torch._dynamo.reset()
    for on in ("false", "true"):
        distill(load_recipe(BASE_RECIPE, run_overrides(stages=_stages(on))), tmp_path / on, progress=False)
    torch._dynamo.reset()
    # the probe, and layers traced in each stage (compiled again after the first undid it)
    assert backend.graphs >= 3
    losses = {
        on: [
            r["loss"]
            for r in map(json.loads, (tmp_path / on / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        ]
        for on in ("false", "true")
    }
    assert len(losses["true"]) > 3 and losses["true"] == pytest.approx(losses["false"], rel=1e-5)
    eager, compiled = (load_file(tmp_path / on / "student/model.safetensors") for on in ("false", "true"))
    assert compiled.keys() == eager.keys()  # in place: the checkpoint's names are the eager student's
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5, msg=name)
