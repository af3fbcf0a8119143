"""The distillation loop end to end on a tiny teacher: artifacts, resume after SIGKILL, NaN stop."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelerate_launch import accelerate_launch
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill, latest_checkpoint
from attn2ssm.errors import ConfigError, TrainingError
from tiny_models import BASE_RECIPE


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _weights(run: Path) -> dict:
    return load_file(run / "student" / "model.safetensors")


def test_end_to_end_artifacts(run_overrides, tmp_path):
    out = tmp_path / "run"
    results = distill(load_recipe(BASE_RECIPE, run_overrides()), out, progress=False)
    for name in (
        "recipe.yaml",
        "metrics.jsonl",
        "results.json",
        "report.md",
        "loss.png",
        "student/config.json",
        "student/tokenizer.json",
    ):
        assert (out / name).exists(), name
    assert results["teacher_ppl"] > 1 and results["student_ppl"] > 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kd = [r for r in records if r["stage"] == "kd"]
    ce = [r for r in records if r["stage"] == "ce"]
    lora = [r for r in records if r["stage"] == "lora"]
    # ceil(tokens / (batch × block_len)) steps per stage
    assert len(kd) == 12 and len(ce) == 6 and len(lora) == 3
    assert kd[-1]["loss"] < kd[0]["loss"]  # the KL to the teacher falls
    assert "eval_loss" in kd[3] and "eval_loss" in kd[-1]
    assert ce[-1]["total_tokens"] == 1536 + 768
    assert latest_checkpoint(out).name == "stage2-step000003"
    # keep_checkpoints=2 → older ones pruned
    assert len([p for p in (out / "checkpoints").iterdir() if p.is_dir()]) == 2
    report = (out / "report.md").read_text()
    assert "teacher" in report and f"{results['student_ppl']:.2f}" in report


def test_existing_run_dir_is_not_overwritten(run_overrides, tmp_path):
    out = tmp_path / "run"
    distill(
        load_recipe(BASE_RECIPE, run_overrides(stages="[{name: a, kind: ce, tokens: 128, batch_size: 4}]")),
        out,
        progress=False,
    )
    before = (out / "student" / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="already holds a run"):
        distill(load_recipe(BASE_RECIPE, run_overrides()), out, progress=False)
    assert (out / "student" / "model.safetensors").read_bytes() == before


KILLER = r"""
import os, signal, sys, torch
import attn2ssm.distill.trainer as T
from attn2ssm.distill.recipe import load_recipe
from tiny_models import BASE_RECIPE

mode, out, *sets = sys.argv[1:]
saves = {"done": 0, "writes": 0}
original_save = T.Distiller._save_checkpoint
original_torch_save = torch.save

def save_then_die(self, *args, **kwargs):
    original_save(self, *args, **kwargs)
    saves["done"] += 1
    if (mode == "after" and saves["done"] == 2) or (mode == "lora" and saves["done"] == 8):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-stage (stage 0, or the LoRA stage), after a complete checkpoint

def die_while_writing(obj, path, *args, **kwargs):
    if mode == "during" and str(getattr(path, "name", path)).endswith("optimizer.pt"):  # a path or an open file
        saves["writes"] += 1
        if saves["writes"] == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-checkpoint: the model is written, the rest is not
    return original_torch_save(obj, path, *args, **kwargs)

T.Distiller._save_checkpoint = save_then_die
torch.save = die_while_writing
T.distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
"""


@pytest.mark.parametrize("mode", ["after", "during", "lora"])
def test_sigkill_then_resume_matches_uninterrupted(mode, run_overrides, tmp_path):
    sets = run_overrides()
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)

    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, mode, str(killed), *sets],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # really killed
    assert not (killed / "student").exists()
    ckpt = latest_checkpoint(killed)
    expected = "stage2-step000002" if mode == "lora" else "stage0-step000006"  # 'during' died writing step 9
    assert ckpt is not None and ckpt.name == expected
    if mode == "during":  # the half-written checkpoint never became 'latest'
        assert any(p.name.startswith(".tmp-") for p in (killed / "checkpoints").iterdir())

    cli = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", "--out", str(killed), "--resume", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    # the resume removed the half-written one
    assert not [p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    a, b = _weights(reference), _weights(killed)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6, msg=name)
    # the metrics log holds each step once, as if never interrupted
    steps = [
        (r["stage_index"], r["step"])
        for r in map(json.loads, (killed / "metrics.jsonl").read_text().splitlines())
    ]
    assert steps == sorted(set(steps)) and len(steps) == 21
    ref_losses = [json.loads(line)["loss"] for line in (reference / "metrics.jsonl").read_text().splitlines()]
    losses = [json.loads(line)["loss"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(run_overrides, tmp_path, monkeypatch):
    from attn2ssm.distill import stages

    kind = stages.STAGE_KINDS["kd"]
    calls = {"n": 0}
    original = type(kind).loss

    def poisoned(self, *args, **kwargs):
        calls["n"] += 1
        loss, metrics = original(self, *args, **kwargs)
        return (loss * float("nan") if calls["n"] == 5 else loss), metrics

    monkeypatch.setattr(type(kind), "loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(TrainingError) as err:
        distill(load_recipe(BASE_RECIPE, run_overrides()), out, progress=False)
    msg = str(err.value)
    assert "non-finite loss" in msg and "step 5" in msg and "stage0-step000003" in msg and "\n" not in msg
    assert latest_checkpoint(out).name == "stage0-step000003"
    assert not (out / "student").exists()


def test_two_processes_give_the_same_loss_curve(run_overrides, tmp_path):
    """accelerate launch --num_processes 2 (gloo, CPU) vs one process, same global batch."""
    sets = run_overrides()
    one = tmp_path / "one"
    two = tmp_path / "two"
    env = _env()
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU (gloo) case on any machine: one GPU cannot host two ranks
    r1 = subprocess.run(
        [
            sys.executable,
            "-m",
            "attn2ssm",
            "distill",
            BASE_RECIPE,
            "--out",
            str(one),
            "--no-progress",
            *sum((["--set", s] for s in sets), []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = subprocess.run(
        accelerate_launch(
            "-m",
            "attn2ssm",
            "distill",
            BASE_RECIPE,
            "--out",
            str(two),
            "--no-progress",
            *sum((["--set", s] for s in sets), []),
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    m1 = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    m2 = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert {r["processes"] for r in m1} == {1} and {r["processes"] for r in m2} == {2}
    l1, l2 = [r["loss"] for r in m1], [r["loss"] for r in m2]
    assert len(l1) == len(l2) == 21
    assert l2 == pytest.approx(l1, rel=1e-4, abs=1e-5)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # as after a full disk or a kill mid-copy


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.pt"])
def test_resume_from_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(
    damaged, run_overrides, tmp_path
):
    sets = run_overrides()
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, "after", str(killed), *sets],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert latest_checkpoint(killed).name == "stage0-step000006"
    _truncate(killed / "checkpoints" / "stage0-step000006" / damaged)

    cli = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", "--out", str(killed), "--resume", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    notice = [line for line in (cli.stdout + cli.stderr).splitlines() if line.startswith("checkpoint ")]
    assert (
        len(notice) == 1
        and "stage0-step000006" in notice[0]
        and damaged in notice[0]
        and "stage0-step000003" in notice[0]
    )
    a, b = _weights(reference), _weights(killed)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-6, msg=name)
    steps = [
        (r["stage_index"], r["step"])
        for r in map(json.loads, (killed / "metrics.jsonl").read_text().splitlines())
    ]
    assert steps == sorted(set(steps)) and len(steps) == 21


def test_resume_with_every_checkpoint_damaged_changes_nothing(run_overrides, tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, "after", str(killed), *run_overrides()],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    for ckpt in (killed / "checkpoints").iterdir():
        if ckpt.is_dir():
            _truncate(ckpt / "model.safetensors")
    metrics = (killed / "metrics.jsonl").read_bytes()
    cli = subprocess.run(
        [sys.executable, "-m", "attn2ssm", "distill", "--out", str(killed), "--resume", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cli.returncode == 2
    err = cli.stderr.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0] and "stage0-step000006" in err[0]
    assert (killed / "metrics.jsonl").read_bytes() == metrics  # nothing on disk changed
