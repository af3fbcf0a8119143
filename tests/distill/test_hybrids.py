"""Hybrid students in the trainer: stepwise schedules (Mamba in the Llama), automatic layer selection,
random-init baselines, SSM mixers in layer-local stages, and SFT data sampled from the teacher."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill
from attn2ssm.errors import ConfigError
from attn2ssm.student.modeling import Attn2SSMForCausalLM
from tiny_models import BASE_RECIPE, Crash, assert_same_student, crash_after

KD_CE = "{name: %s, kind: kd_ce, tokens: 256, batch_size: 4, save_every: 1, optim: {lr: 0.01}%s}"


def _stepwise_sets(run_overrides, mixer: str) -> list[str]:
    """A stepwise schedule on the 2-layer teacher: stage "half" (layer 0 converted to ``mixer``), then
    stage "none" (layer 1 converted too)."""
    stages = "[" + KD_CE % ("half", "") + ", " + KD_CE % ("none", ", attention_ratio: 0.0") + "]"
    return run_overrides(
        **{
            "stages": stages,
            "student.mixer": mixer,
            "student.mixer_options": "{}",
            "student.attention_ratio": 0.5,
        }
    )


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_stepwise_schedule_converts_more_layers_and_carries_trained_mixers(run_overrides, tmp_path):
    """50 % → 0 % on a 2-layer teacher: layer 0 is converted and trained first, then layer 1 is
    converted from attention while layer 0 keeps what it learnt."""
    out = tmp_path / "run"
    overrides = _stepwise_sets(run_overrides, "mamba2")
    distill(load_recipe(BASE_RECIPE, overrides), out, progress=False)
    final = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert final.config.layer_plan == ["mamba2", "mamba2"]
    stage_names = {r["stage"] for r in _records(out) if "stage" in r}
    assert stage_names == {"half", "none"}


def test_stepwise_growth_keeps_stage_one_weights(run_overrides, tmp_path):
    """The grown student's layer-0 mixer starts stage 2 with stage 1's trained weights."""
    import attn2ssm.distill.trainer as T

    captured = {}
    original = T.Distiller._grow_for_stage

    def spy(self, stage_idx, cfg):
        before = {k: v.clone() for k, v in self.acc.unwrap_model(self.student).state_dict().items()}
        original(self, stage_idx, cfg)
        captured[stage_idx] = (
            before,
            {k: v.clone() for k, v in self.acc.unwrap_model(self.student).state_dict().items()},
        )

    overrides = _stepwise_sets(run_overrides, "mamba2")
    T.Distiller._grow_for_stage = spy
    try:
        distill(load_recipe(BASE_RECIPE, overrides), tmp_path / "run", progress=False)
    finally:
        T.Distiller._grow_for_stage = original
    before, after = captured[1]
    layer0 = [k for k in before if ".layers.0." in k]
    diff = [k for k in layer0 if not torch.equal(before[k], after[k])]
    assert layer0 and not diff, diff
    assert any(".layers.1.self_attn.dt_proj" in k for k in after) and not any(
        ".layers.1.self_attn.dt_proj" in k for k in before
    )


def test_stepwise_ratio_must_not_grow(run_overrides):
    stages = "[" + KD_CE % ("a", "") + ", " + KD_CE % ("b", ", attention_ratio: 0.75") + "]"
    with pytest.raises(ConfigError, match="only converts more layers"):
        load_recipe(BASE_RECIPE, run_overrides(**{"stages": stages, "student.attention_ratio": 0.5}))


def test_auto_keep_attention_logs_scores(run_overrides, tmp_path):
    out = tmp_path / "run"
    overrides = run_overrides(
        **{
            "stages": "[" + KD_CE % ("a", "") + "]",
            "student.mixer": "mamba2",
            "student.mixer_options": "{}",
            "student.attention_ratio": 0.5,
            "student.keep_attention": "auto",
            "student.auto_calibration_blocks": 2,
        }
    )
    distill(load_recipe(BASE_RECIPE, overrides), out, progress=False)
    selection = [r for r in _records(out) if r.get("event") == "layer_selection"]
    assert len(selection) == 1 and len(selection[0]["scores"]) == 2
    scores, kept = selection[0]["scores"], selection[0]["keep_attention"]
    assert kept == [max(range(2), key=lambda i: (scores[i], -i))]
    final = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert [i for i, k in enumerate(final.config.layer_plan) if k == "attention"] == kept


def test_random_init_and_placement_options(run_overrides, tmp_path, tiny_setup):
    teacher_dir, _ = tiny_setup
    out = tmp_path / "run"
    overrides = run_overrides(
        **{
            "stages": "[{name: a, kind: ce, tokens: 128, batch_size: 4, optim: {lr: 0.0}}]",
            "student.mixer": "mamba2",
            "student.mixer_options": "{}",
            "student.attention_ratio": 0.5,
            "student.init": "random",
            "student.align": "first",
        }
    )
    distill(load_recipe(BASE_RECIPE, overrides), out, progress=False)
    student = load_file(out / "student" / "model.safetensors")
    teacher = load_file(teacher_dir / "model.safetensors")
    assert Attn2SSMForCausalLM.from_pretrained(out / "student").config.layer_plan == ["attention", "mamba2"]
    assert not torch.equal(
        student["base.model.layers.1.self_attn.q_proj.weight"],
        teacher["model.layers.1.self_attn.q_proj.weight"],
    )
    assert torch.equal(
        student["base.model.layers.0.self_attn.q_proj.weight"],
        teacher["model.layers.0.self_attn.q_proj.weight"],
    )
    with pytest.raises(ConfigError, match="student.init"):
        load_recipe(BASE_RECIPE, run_overrides(**{"student.init": "xavier"}))


def test_output_alignment_stage_runs_on_ssm_mixers_and_attention_loss_is_refused(run_overrides, tmp_path):
    stage = "[{name: align, kind: attention_transfer, tokens: 256, batch_size: 4, trainable: [mixers], losses: {attention: 0.0, output_mse: 1.0}}]"
    out = tmp_path / "run"
    distill(
        load_recipe(
            BASE_RECIPE,
            run_overrides(**{"stages": stage, "student.mixer": "mamba2", "student.mixer_options": "{}"}),
        ),
        out,
        progress=False,
    )
    recs = [r for r in _records(out) if r.get("stage") == "align"]
    assert recs and all("train_mse" in r for r in recs)
    bad = "[{name: align, kind: attention_transfer, tokens: 256, batch_size: 4, losses: {attention: 1.0}}]"
    with pytest.raises(ConfigError, match="normalised weights"):
        distill(
            load_recipe(
                BASE_RECIPE,
                run_overrides(**{"stages": bad, "student.mixer": "mamba", "student.mixer_options": "{}"}),
            ),
            tmp_path / "bad",
            progress=False,
        )


def test_sft_on_teacher_sampled_replies(chat_overrides, tmp_path, monkeypatch):
    """data.source teacher:<corpus>:<n> samples the teacher once into the cache and trains on it."""
    import attn2ssm.data.teacher_samples as TS

    calls = []
    original = TS.build_teacher_sft_data

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("attn2ssm.distill.run_data.build_teacher_sft_data", counting)
    stage = "[{name: sft, kind: sft, epochs: 1, batch_size: 2, trainable: [all], data: {source: 'teacher:%s:4', max_len: 96}}]"
    overrides = chat_overrides(stage % "CORPUS")
    corpus = next(o for o in overrides if o.startswith("data.corpus=")).split("=", 1)[1]
    overrides = chat_overrides(stage % corpus)
    distill(load_recipe(BASE_RECIPE, overrides), tmp_path / "a", progress=False)
    files = list(
        (Path(__import__("attn2ssm.paths", fromlist=["cache_dir"]).cache_dir()) / "teacher_samples").glob(
            "*.jsonl"
        )
    )
    assert len(files) == 1
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert 1 <= len(records) <= 4 and all(
        [m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records
    )
    stamp = files[0].stat().st_mtime_ns
    distill(load_recipe(BASE_RECIPE, overrides), tmp_path / "b", progress=False)
    assert files[0].stat().st_mtime_ns == stamp  # reused, not regenerated
    sft = [r for r in _records(tmp_path / "b") if r.get("stage") == "sft"]
    assert sft and all(torch.isfinite(torch.tensor(r["loss"])) for r in sft)
    assert len(calls) == 2


def test_teacher_source_parsing():
    from attn2ssm.data.teacher_samples import parse_teacher_source

    assert parse_teacher_source("teacher:sotu") == ("sotu", 128)
    assert parse_teacher_source("teacher:sotu:16") == ("sotu", 16)
    assert parse_teacher_source("teacher:/data/my corpus:8") == ("/data/my corpus", 8)
    with pytest.raises(ConfigError, match="names no corpus"):
        parse_teacher_source("teacher:")


def test_mamba_in_llama_recipe_runs_end_to_end(chat_overrides, tmp_path):
    """The built-in recipe, budgets shrunk, on the tiny chat teacher: stepwise kd_ce stages, then SFT
    on replies the teacher samples for prompts cut from the corpus."""
    base = chat_overrides("[]")
    corpus = next(o for o in base if o.startswith("data.corpus=")).split("=", 1)[1]
    overrides = [o for o in base if not o.startswith("stages=")]
    overrides += [f"stages.{i}.tokens=128" for i in range(3)] + [f"stages.{i}.batch_size=2" for i in range(4)]
    overrides += [
        f"stages.3.data.source=teacher:{corpus}:4",
        "stages.3.data.max_len=96",
        "eval.max_tokens=256",
    ]
    recipe = load_recipe("mamba_in_llama", overrides)
    assert [s.kind for s in recipe.stages] == ["kd_ce", "kd_ce", "kd_ce", "sft"]
    out = tmp_path / "run"
    distill(recipe, out, progress=False)
    final = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert final.config.layer_plan == ["mamba2", "mamba2"]  # 50 % of 2 layers, then 25 % → 0 kept
    stages = [r["stage"] for r in _records(out)]
    assert stages.index("hybrid_50") < stages.index("hybrid_25") < stages.index("sft")
    assert json.loads((out / "results.json").read_text())["student_ppl"] > 1


# 2: at the end of stage 1 (before growing); 3: inside stage 2
@pytest.mark.parametrize("crash_after_saves", [2, 3])
def test_stepwise_resume_matches_uninterrupted(run_overrides, tmp_path, monkeypatch, crash_after_saves):
    """A run killed at the stage boundary or inside the grown stage resumes to the same student."""
    sets = _stepwise_sets(run_overrides, "mamba2")
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)

    crash_after(monkeypatch, crash_after_saves)
    crashed = tmp_path / "crashed"
    with pytest.raises(Crash):
        distill(load_recipe(BASE_RECIPE, sets), crashed, progress=False)
    monkeypatch.undo()
    distill(load_recipe(BASE_RECIPE, sets), crashed, resume=True, progress=False)
    assert_same_student(reference, crashed)
    assert Attn2SSMForCausalLM.from_pretrained(crashed / "student").config.layer_plan == ["mamba2", "mamba2"]
    assert [r["loss"] for r in _records(crashed) if "loss" in r] == pytest.approx(
        [r["loss"] for r in _records(reference) if "loss" in r], rel=1e-6
    )


def test_gated_delta_decays_calibrated_on_a_fresh_student_and_on_grown_layers_only(run_overrides, tmp_path):
    """decay_init: calibrated (gated_delta's default) is applied by the trainer: layer 0 when the
    student is built, layer 1 when a stepwise schedule converts it — the grown student keeps layer 0's
    trained decays. Each calibration is one metrics event with the per-head α, β it set."""
    out = tmp_path / "run"
    overrides = _stepwise_sets(run_overrides, "gated_delta")
    distill(load_recipe(BASE_RECIPE, overrides), out, progress=False)
    events = [r for r in _records(out) if r.get("event") == "decay_calibration"]
    assert [sorted(e["layers"]) for e in events] == [["0"], ["1"]]
    final = load_file(out / "student" / "model.safetensors")
    alpha1 = torch.tensor(events[1]["layers"]["1"]["alpha"])
    assert alpha1.min() > 0 and alpha1.max() < 1 and alpha1.std() > 0  # per head, from the teacher
    # layer 1 trained for one stage after its calibration; layer 0 trained over both: neither back at a constant
    for layer in (0, 1):
        (dt_bias,) = [v for k, v in final.items() if f"layers.{layer}." in k and k.endswith("dt_bias")]
        assert dt_bias.std() > 0


def test_kept_attention_in_qwen35_form_calibrates_trains_with_the_mixers_and_exports(run_overrides, tmp_path):
    """student.kept_attention: qwen35 — the kept layer's q/k norms are calibrated at build (logged),
    its gate and norms train in a `trainable: [mixers]` stage, and the run's student exports to
    Qwen3_5ForCausalLM (the export probes it against the student)."""
    from attn2ssm.export.native import export_native

    out = tmp_path / "run"
    overrides = run_overrides(
        **{
            "stages": "[" + KD_CE % ("kd", ", trainable: [mixers]") + "]",
            "student.mixer": "gated_delta",
            "student.mixer_options": "{gate_bias: false, beta_bias: false, conv_bias: false, norm_eps: auto}",
            "student.attention_ratio": 0.5,
            "student.kept_attention": "qwen35",
        }
    )
    distill(load_recipe(BASE_RECIPE, overrides), out, progress=False)
    student = Attn2SSMForCausalLM.from_pretrained(out / "student")
    assert student.config.kept_attention == "qwen35"
    (i, kept), *_ = student.kept_attention_layers().items()
    assert kept.g_proj.weight.abs().max() > 0  # trained off its zero init
    assert [r for r in _records(out) if r.get("event") == "kept_attention_calibration"]
    result = export_native(out / "student", tmp_path / "native")
    assert result.layer_types[i] == "full_attention" and "linear_attention" in result.layer_types


def test_kept_attention_form_is_validated_in_one_line():
    with pytest.raises(ConfigError, match="student.kept_attention='gated' is not valid"):
        load_recipe(BASE_RECIPE, ["student.kept_attention=gated"])
