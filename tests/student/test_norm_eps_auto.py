"""``norm_eps: auto``: the Mamba-2 gated norm's ε is the teacher's own norm ε, resolved when the
student is built (convert, a grown stage, a probed layer), so the saved config records the number;
and the recipes meant to be served use it, so their students export natively by default (issue 20)."""

import json

import pytest
import torch

from attn2ssm.distill.recipe import load_recipe
from attn2ssm.errors import ConfigError
from attn2ssm.export.native import native_problem
from attn2ssm.mixers.registry import build_mixer
from attn2ssm.student.convert import (
    convert,
    converted_layer,
    grow_student,
    resolve_options,
)
from attn2ssm.student.plans import make_plan
from tiny_models import tiny_model

SERVED = ["mamba_in_llama", "hybrid50", "hybrid25", "hybrid12", "mamba2_pure"]
AUTO = {"norm": True, "norm_eps": "auto"}


def _teacher(family="llama", layers=None, **overrides):
    teacher = tiny_model(family, layers=layers)
    for key, value in overrides.items():
        setattr(teacher.config, key, value)
    return teacher


@pytest.mark.parametrize("kind", ["mamba2", "discrete_mamba2"])
def test_auto_is_the_teachers_rms_norm_eps_and_is_saved_as_the_number(kind, tmp_path):
    teacher = _teacher(rms_norm_eps=3e-5)
    student = convert(teacher, [kind, "attention"], {kind: AUTO})
    assert student.config.mixer_options[kind] == {"norm": True, "norm_eps": 3e-5}
    assert student.mixers()[0].norm.eps == 3e-5
    student.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mixer_options"][kind]["norm_eps"] == 3e-5


@pytest.mark.parametrize(
    "family, attribute",
    [("phi", "layer_norm_eps"), ("gpt_neox", "layer_norm_eps"), ("gpt2", "layer_norm_epsilon")],
)
def test_auto_on_a_layernorm_teacher_is_its_layernorm_eps(family, attribute):
    teacher = _teacher(family, **{attribute: 2e-5})
    student = convert(teacher, ["mamba2", "mamba2"], {"mamba2": AUTO})
    assert student.mixers()[0].norm.eps == 2e-5


def test_auto_without_a_usable_teacher_eps_is_one_line():
    teacher = _teacher(rms_norm_eps=0.0)
    with pytest.raises(ConfigError, match=r"norm_eps: auto found the teacher's norm ε 0\.0") as info:
        convert(teacher, ["mamba2", "attention"], {"mamba2": AUTO})
    assert "\n" not in str(info.value)
    with pytest.raises(
        ConfigError, match="needs the teacher's rms_norm_eps, and its config has none"
    ) as info:
        # a config without a norm ε
        resolve_options({"mamba2": AUTO}, {"model_type": "some_family", "hidden_size": 64})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("bad", ["automatic", "Auto", "", -1e-5, 0])
def test_other_values_stay_a_one_line_error(bad):
    with pytest.raises(ConfigError, match="norm_eps") as info:
        convert(_teacher(), ["mamba2", "attention"], {"mamba2": {"norm": True, "norm_eps": bad}})
    assert "\n" not in str(info.value) and "auto" in str(info.value)  # the fix names auto


def test_a_mixer_built_on_its_own_cannot_resolve_auto():
    geometry = convert(_teacher(), ["attention", "attention"]).config.layer_geometry[0]
    with pytest.raises(ConfigError, match="auto reached a mixer built without its teacher"):
        build_mixer("mamba2", geometry, 0, AUTO)


def test_grown_stages_and_probed_layers_resolve_auto_too():
    teacher = _teacher(layers=4, rms_norm_eps=4e-5)
    student = convert(teacher, ["mamba2", "attention", "attention", "attention"], {"mamba2": AUTO})
    # the recipe's options (still "auto") equal the trained student's resolved ones: growing is allowed
    grown = grow_student(student, teacher, ["mamba2", "mamba2", "attention", "attention"], {"mamba2": AUTO})
    assert grown.mixers()[1].norm.eps == 4e-5 and grown.config.mixer_options["mamba2"]["norm_eps"] == 4e-5
    with converted_layer(grown, 2, "mamba2", AUTO) as mixer:  # layer selection's probe
        assert mixer.norm.eps == 4e-5
        assert grown.config.mixer_options["mamba2"]["norm_eps"] == 4e-5


@pytest.mark.parametrize("name", SERVED)
def test_served_recipes_build_natively_exportable_students(name):
    """Each recipe's student options on a Llama-family teacher (ε 1e-5, as SmolLM2's) give a student
    that GraniteMoeHybrid expresses exactly, at every attention ratio its stages use."""
    recipe = load_recipe(name)
    s = recipe.student
    assert s.mixer == "mamba2" and s.mixer_options == {"norm": True, "norm_eps": "auto"}
    teacher = _teacher(layers=8, rms_norm_eps=1e-5)
    ratios = {
        s.attention_ratio,
        *(st.attention_ratio for st in recipe.stages if st.attention_ratio is not None),
    }
    for ratio in sorted(ratios):
        plan = make_plan(8, s.mixer, attention_ratio=ratio)
        student = convert(teacher, plan, {s.mixer: dict(s.mixer_options)})
        assert native_problem(student.config) is None, (name, ratio, native_problem(student.config))
        with torch.no_grad():
            assert torch.isfinite(
                student(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=False).logits
            ).all()
