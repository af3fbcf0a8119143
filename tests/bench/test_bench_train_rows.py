"""``bench train``'s GDN case (gdn_hybrid25's student in KD) and its JSON written row by row: a run
killed after its first row leaves that row on disk."""

import json

import pytest

import attn2ssm.bench.train as bench_train
from attn2ssm.bench.train import CASES, TrainBenchSettings, run_train_bench
from attn2ssm.cli import main
from attn2ssm.distill.recipe import load_recipe


def test_the_gdn_case_is_gdn_hybrid25_s_student(tiny_setup):
    student, stage = CASES["kd_gdn"]
    recipe = load_recipe("gdn_hybrid25")
    assert student == recipe.student and student.mixer == "gated_delta"
    assert stage.kind == "kd" and stage.trainable == ["mixers"]
    teacher_dir, corpus_dir = tiny_setup
    settings = TrainBenchSettings(
        teacher=str(teacher_dir),
        corpus=str(corpus_dir),
        cases=("kd_gdn",),
        lengths=(32,),
        step_tokens=64,
        steps=1,
        precisions=("no",),
        profile=False,
    )
    seen = []
    result = run_train_bench(settings, progress=False, on_row=lambda r: seen.append(len(r["rows"])))
    (row,) = result["rows"]
    assert row["case"] == "kd_gdn" and row["mixer"] == "gated_delta" and row["kind"] == "kd"
    assert row["tokens_per_s"] > 0 and row["teacher_forward"] > 0 and row["trainable_params"] > 0
    assert row["kernels"] == "torch"  # on the CPU
    assert seen == [1] and result["complete"] is True


def test_a_failure_after_the_first_row_keeps_it(tiny_setup, tmp_path, monkeypatch, capsys):
    teacher_dir, corpus_dir = tiny_setup
    real, calls = bench_train.measure_point, []

    def second_fails(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise RuntimeError("killed while measuring row 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_train, "measure_point", second_fails)
    out = tmp_path / "sub" / "train_speed.json"
    argv = ["bench", "train", "--teacher", str(teacher_dir), "--corpus", str(corpus_dir)]
    argv += ["--cases", "kd_lora,kd_gdn", "--lengths", "32", "--step-tokens", "32", "--steps", "1"]
    argv += ["--precisions", "no", "--no-profile", "--no-progress", "--out", str(out)]
    with pytest.raises(RuntimeError, match="row 2"):
        main(argv)
    result = json.loads(out.read_text())
    assert [r["case"] for r in result["rows"]] == ["kd_lora"] and result["complete"] is False
    assert result["command"].startswith("attn2ssm bench train")
    assert not out.with_suffix(".png").exists()  # the figure comes with the complete result
