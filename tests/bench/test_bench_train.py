"""``attn2ssm bench train`` on the tiny teacher: every stage case runs through the real trainer
step, in fp32 and bf16, next to the teacher's forward and forward + backward on the same batches."""

import json

import pytest

from attn2ssm.bench.train import CASES, TrainBenchSettings, run_train_bench
from attn2ssm.cli import main


def test_every_case_is_measured_against_the_teacher(tiny_setup):
    teacher_dir, corpus_dir = tiny_setup
    settings = TrainBenchSettings(
        teacher=str(teacher_dir), corpus=str(corpus_dir), lengths=(32,), step_tokens=64, steps=1
    )
    result = run_train_bench(settings, progress=False)
    rows = result["rows"]
    assert {(r["case"], r["precision"]) for r in rows} == {(c, p) for c in CASES for p in ("no", "bf16")}
    for r in rows:
        assert r["batch"] == 2 and r["length"] == 32 and r["trainable_params"] > 0
        assert r["tokens_per_s"] > 0 and r["teacher_forward"] > 0 and r["teacher_fwd_bwd"] > 0
        assert r["fraction_of_forward_bound"] == pytest.approx(r["tokens_per_s"] / r["teacher_forward"])
        assert r["top_ops"] and abs(sum(op["share"] for op in r["top_ops"])) <= 1.0 + 1e-9
        # filled first: every timed and profiled step reads the teacher from the cache
        if r["case"] == "kd_lora_cached":
            cache = r["logit_cache"]
            assert cache["misses"] == 0 and cache["hits"] == 3 * 2 and cache["top_k"] == 64
            assert (
                cache["bytes_per_token"] == pytest.approx(6 * 64 + 4, rel=0.2)
                and cache["fill_tokens_per_s"] > 0
            )


def test_the_command_writes_json_and_png(tiny_setup, tmp_path, capsys):
    teacher_dir, corpus_dir = tiny_setup
    out = tmp_path / "train_speed.json"
    code = main(
        [
            "bench",
            "train",
            "--teacher",
            str(teacher_dir),
            "--corpus",
            str(corpus_dir),
            "--cases",
            "kd_lora",
            "--lengths",
            "32",
            "--step-tokens",
            "32",
            "--steps",
            "1",
            "--precisions",
            "no",
            "--no-profile",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert [r["case"] for r in result["rows"]] == ["kd_lora"] and result["rows"][0]["top_ops"] == []
    assert result["command"].startswith("attn2ssm bench train") and out.with_suffix(".png").exists()
    assert "kd_lora" in capsys.readouterr().out


def test_an_unknown_case_is_one_line(tiny_setup, capsys):
    assert main(["bench", "train", "--cases", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "attention_transfer" in err[0]
