"""``bench generate``'s long-context students (``RECIPE_STUDENTS``): ``linear_hybrid25`` and
``retrieval_heads`` are built from the teacher by the recipes' own code with the recipes' mixer
options, kept layers and kept KV groups (the built-in teacher's choices for a teacher of its shape);
the benchmark's decode path (CPU decode layout, ``--compile``, prefill then rounds) decodes the same
greedy tokens as a plain ``generate``; ``--models NAME=DIR`` times a trained student; the JSON names
every row."""

import copy
import json

import pytest
import torch

from attn2ssm.bench.generate import (
    BUILTIN_KEPT_GROUPS,
    BUILTIN_KEPT_LAYERS,
    build_models,
    decode_round,
    plain_generate,
    prefill,
    warm_up,
)
from attn2ssm.decode.layout import cpu_decode_layout
from attn2ssm.decode.plan import DecodePlan, compiled_step_status
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.retrieval_probe import kv_group_budget
from attn2ssm.eval.kv_cache import kv_fraction
from attn2ssm.student.plans import interleaved_keep
from tiny_models import perturb_new_mixer_parameters, save_tiny_teacher_and_corpus, tiny_model

NAMES = ["linear_hybrid25", "retrieval_heads"]


def _builtin_shaped_teacher():
    """SmolLM2-135M's layout of heads (30 layers of 9 query heads over 3 KV groups), tiny widths."""
    return tiny_model("gqa_9x3", layers=30)


def test_the_recipe_students_have_the_recipes_architecture():
    teacher = _builtin_shaped_teacher()
    models = build_models(teacher, NAMES, torch.device("cpu"))
    hybrid, heads = models["linear_hybrid25"], models["retrieval_heads"]
    for name, student in models.items():
        s = load_recipe(name).student
        assert student.config.mixer_options[s.mixer] == s.mixer_options
        assert s.mixer_options["window"] == 64 and s.mixer_options["rope"] == "window"
        assert s.mixer_options["decay"] is True and s.mixer_options["decay_horizon"] == 512
    # linear_hybrid25: the layers KL-guided selection kept on the built-in teacher, 25 % of 30
    plan = hybrid.config.layer_plan
    assert [i for i, kind in enumerate(plan) if kind == "attention"] == BUILTIN_KEPT_LAYERS
    assert set(plan) == {"attention", "linear_attention"} and len(BUILTIN_KEPT_LAYERS) == round(0.25 * 30)
    assert kv_fraction(hybrid, teacher).kv_fraction == pytest.approx(8 / 30)
    # retrieval_heads: no attention layer; one softmax KV group in each of 4 layers, the budget's count
    recipe = load_recipe("retrieval_heads").student
    plan = heads.config.layer_plan
    kept = {str(i): m.kept_groups for i, m in heads.mixers().items() if getattr(m, "kept_groups", None)}
    assert kept == BUILTIN_KEPT_GROUPS and "attention" not in plan
    assert [i for i, kind in enumerate(plan) if kind == "linear_attention_heads"] == [6, 17, 18, 23]
    assert heads.config.mixer_options["linear_attention_heads"] == {
        **recipe.mixer_options,
        "softmax_kv_heads": BUILTIN_KEPT_GROUPS,
    }
    assert sum(map(len, kept.values())) == kv_group_budget(recipe.keep_heads.kv_budget, 90) == 4
    memory = kv_fraction(heads, teacher)
    assert memory.kv_fraction == pytest.approx(4 / 90) and memory.kv_fraction <= recipe.keep_heads.kv_budget
    assert heads.config.retrieval_probe["source"] == "listed (student.keep_heads.groups)"
    assert "the built-in teacher's choices" in heads.bench_model and "17" in heads.bench_model


def test_a_teacher_of_another_shape_gets_make_plans_layers_and_the_budgets_count():
    teacher = tiny_model("gqa_9x3", layers=20)  # 60 KV groups: 5 % is 3
    models = build_models(teacher, NAMES, torch.device("cpu"))
    plan = models["linear_hybrid25"].config.layer_plan
    assert [i for i, kind in enumerate(plan) if kind == "attention"] == interleaved_keep(20, 0.25, "last")
    heads = models["retrieval_heads"]
    kept = {i: m.kept_groups for i, m in heads.mixers().items() if getattr(m, "kept_groups", None)}
    assert sorted(kept) == interleaved_keep(20, 3 / 20, "last") and all(g == [0] for g in kept.values())
    assert kv_fraction(heads, teacher).kv_fraction == pytest.approx(3 / 60)
    assert "not the built-in teacher's shape" in heads.bench_model


class _TracingBackend:
    """A torch.compile backend that only counts traces (runs the graph as traced)."""

    def __init__(self):
        self.traces = 0

    def __call__(self, graph_module, example_inputs):
        self.traces += 1
        return graph_module.forward


def test_the_bench_decode_path_generates_what_plain_generate_does(monkeypatch):
    """Past the 64-token window, through the CPU decode layout with --compile: linear_hybrid25 has
    no decode plan (HF's forward), retrieval_heads' plan runs every one-token call eagerly (its
    kept layers have no one-token step; the others step their full windows), and both say so; the
    rounds' tokens are plain generate's."""
    from attn2ssm.decode import compiled as compiled_step

    tracer = _TracingBackend()
    monkeypatch.setattr(compiled_step, "BACKEND", tracer)
    plan_calls = []
    original = DecodePlan.__call__

    def counted(self, *args, **kwargs):
        plan_calls.append(self.model)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodePlan, "__call__", counted)
    torch.manual_seed(1)
    models = build_models(_builtin_shaped_teacher(), NAMES, torch.device("cpu"))
    prompt = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(2))
    for name, model in models.items():
        perturb_new_mixer_parameters(model)
        reference = copy.deepcopy(model)
        cpu_decode_layout(model, compile=True)
        warm_up(model, prompt[:, :8])
        status = compiled_step_status(model)
        if name == "linear_hybrid25":
            assert status.startswith("no decode plan: ") and model.__dict__.get("_decode_plan") is None
        else:
            assert status.startswith("not compiled: ") and "eagerly" in status
        rounds = decode_round(model, prefill(model, prompt), 4)["tokens"]
        plain = plain_generate(reference, prompt, 5)["tokens"]
        assert len(rounds) == 4 and rounds == plain[1:]
    assert tracer.traces == 0
    # retrieval_heads' one-token calls went through its decode plan: warm-up 2, a round 4
    assert sum(m is models["retrieval_heads"] for m in plan_calls) == 2 + 4 and not any(
        m is models["linear_hybrid25"] for m in plan_calls
    )


def test_cli_times_the_recipe_students_and_a_trained_student_and_names_them(tmp_path, monkeypatch):
    from attn2ssm.bench.generate import speed
    from attn2ssm.cli import main
    from attn2ssm.decode import compiled as compiled_step

    monkeypatch.setattr(speed, "stream_rate", lambda device: {})  # (streams 512 MB: seconds, not tested here)
    tracer = _TracingBackend()
    monkeypatch.setattr(compiled_step, "BACKEND", tracer)

    teacher, corpus = save_tiny_teacher_and_corpus(tmp_path)
    student = tmp_path / "student"
    argv = ["convert", "--teacher", str(teacher), "--mixer", "linear_attention", "--out", str(student)]
    argv += ["--option", "window=8"]  # (a Mamba-2 student would trace its compiled step: seconds)
    assert main(argv) == 0
    out = tmp_path / "gen.json"
    argv = ["bench", "generate", "--teacher", str(teacher), "--contexts", "16", "--new-tokens", "3"]
    argv += ["--models", f"teacher,linear_hybrid25,retrieval_heads,trained={student}"]
    argv += ["--max-context", "trained=8", "--rounds", "1", "--plain-check", "none", "--compile"]
    argv += ["--corpus", str(corpus), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    names = ["teacher", "linear_hybrid25", "retrieval_heads", "trained"]
    assert list(result["decode"]) == names and list(result["models"]) == names
    assert result["models"]["trained"] == f"trained student {student}"
    assert result["models"]["retrieval_heads"].startswith("untrained retrieval_heads recipe student")
    assert result["decode"]["retrieval_heads"][0]["decode_tokens_per_second"] > 0
    assert result["decode"]["trained"][0]["skipped"] == "longer than --max-context 8 for trained"
    assert result["settings"]["models"][-1] == f"trained={student}"
    # the tiny teacher's 2 layers keep none at 25 %: all three are windowed linear attention; the
    # recipes' 64-token windows are not full at 16 tokens (stepped aside), the trained student's
    # 8-token window is (its warm-up compiles the step once)
    steps = result["compiled_decode_step"]
    assert steps["retrieval_heads"].startswith(
        "not compiled: layer 0 (linear_attention) has no one-token step a trace can run here"
    )
    assert steps["linear_hybrid25"] == steps["retrieval_heads"] and steps["trained"] == "compiled"
    assert tracer.traces == 1
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize(
    "models,needle",
    [
        ("teacher,heads=/nope", "not NAME=DIR with a config.json"),
        ("teacher,retrieval_heads,retrieval_heads", "repeated"),
        ("teacher,linear_hybrid", "unknown"),
    ],
)
def test_bad_models_are_one_line(models, needle, capsys):
    from attn2ssm.cli import main

    assert main(["bench", "generate", "--models", models]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
