"""A run directory under stress: a full disk, a read-only folder, a resume with --set, a resume with
nothing to resume from, a second run on the same --out, and SIGTERM / SIGINT.

Each ends with one line saying what happened and what to do, keeps what was already written, and a
resume afterwards gives the student an uninterrupted run gives (weights compared as in test_trainer).
"""

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import SafetensorError

import attn2ssm.distill.run_dir as run_dir
from attn2ssm.cli import main
from attn2ssm.distill.checkpoints import damage
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import distill, latest_checkpoint
from attn2ssm.errors import ConfigError, OutputError
from read_only import denied_before_the_teacher_loads, not_as_root, read_only_folder
from tiny_models import BASE_RECIPE, Crash, assert_same_student, crash_after


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _steps(run: Path) -> list[tuple[int, int]]:
    return [
        (r["stage_index"], r["step"])
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# ------------------------------------------------------------------------------------ 6. a full disk
def test_a_full_disk_while_checkpointing_keeps_the_last_checkpoint_and_resumes(
    run_overrides, tmp_path, monkeypatch
):
    sets = run_overrides()
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)

    real_save, saves = torch.save, {"n": 0}

    def fills_the_disk(obj, f, *args, **kwargs):
        if str(getattr(f, "name", f)).endswith("optimizer.pt"):
            saves["n"] += 1
            if saves["n"] == 3:  # the checkpoint of step 9: part written, then the disk is full
                f.write(b"\0" * 4096)
                _no_space()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fills_the_disk)
    out = tmp_path / "run"
    with pytest.raises(OutputError) as err:
        distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
    assert str(err.value) == (
        f"cannot write checkpoint stage0-step000009 to {out / 'checkpoints'}: No space left on device "
        f"(stage0-step000006, the last complete checkpoint, is intact) — free space on its disk, then continue with: "
        f"attn2ssm distill --out {out} --resume"
    )
    # no .tmp- left
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "stage0-step000003",
        "stage0-step000006",
    ]
    assert latest_checkpoint(out).name == "stage0-step000006" and damage(latest_checkpoint(out)) is None
    monkeypatch.setattr(torch, "save", real_save)

    # the disk still full at the resume: one line again, no temporary file, the checkpoints untouched
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(OutputError, match=f"cannot write recipe.yaml to {out}: No space left on device"):
        distill(load_recipe(BASE_RECIPE, sets), out, resume=True, progress=False)
    monkeypatch.undo()
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    assert latest_checkpoint(out).name == "stage0-step000006" and damage(latest_checkpoint(out)) is None

    distill(load_recipe(BASE_RECIPE, sets), out, resume=True, progress=False)  # space freed
    assert_same_student(reference, out)
    assert _steps(out) == _steps(reference)


def test_a_full_disk_while_writing_the_student_resumes_to_the_student(run_overrides, tmp_path, monkeypatch):
    from attn2ssm.student.modeling import Attn2SSMForCausalLM

    sets = run_overrides()
    real = Attn2SSMForCausalLM.save_pretrained

    def fills_the_disk(self, directory, *args, **kwargs):
        if Path(directory).name == ".tmp-student":
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / "model.safetensors").write_bytes(b"\0" * 4096)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(self, directory, *args, **kwargs)

    monkeypatch.setattr(Attn2SSMForCausalLM, "save_pretrained", fills_the_disk)
    out = tmp_path / "run"
    with pytest.raises(OutputError) as err:
        distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
    assert str(err.value).startswith(
        f"cannot write the final student to {out}: No space left on device — free space on its disk"
    )
    assert not (out / "student").exists() and not (out / ".tmp-student").exists()
    monkeypatch.undo()
    # every stage was checkpointed: only the student is left
    distill(load_recipe(BASE_RECIPE, sets), out, resume=True, progress=False)
    assert (out / "student" / "model.safetensors").is_file() and (out / "results.json").is_file()
    assert len(_steps(out)) == len(set(_steps(out))) == 21


# ------------------------------------------------------------------------------ 7. a read-only --out
@not_as_root
def test_a_read_only_parent_is_refused_before_the_teacher_loads(run_overrides, tmp_path, capsys):
    with read_only_folder(tmp_path / "ro") as parent:
        assert (
            main(
                [
                    "distill",
                    BASE_RECIPE,
                    "--out",
                    str(parent / "run"),
                    "--no-progress",
                    *sum((["--set", s] for s in run_overrides()), []),
                ]
            )
            == 2
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {parent / 'run'}: {parent} is not writable"), (
        err
    )


def test_an_unwritable_out_is_one_line_before_or_while_writing(run_overrides, tmp_path, monkeypatch, capsys):
    args = [
        "distill",
        BASE_RECIPE,
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
        *sum((["--set", s] for s in run_overrides()), []),
    ]
    with denied_before_the_teacher_loads(tmp_path):  # as if tmp_path were read-only
        assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0]
        == f"error: --out {tmp_path / 'run'}: {tmp_path} is not writable (permission denied) — choose another --out, or make {tmp_path} writable"
    ), err
    assert not (tmp_path / "run").exists()

    def denied(path, text):  # access(2) said yes, the write says no (ACLs, NFS root squash, a race)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(run_dir, "atomic_write_text", denied)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    out = tmp_path / "run"
    assert len(err) == 1 and err[0].startswith(
        f"error: cannot write recipe.yaml to {out}: Permission denied — make {out} writable"
    ), err


# ------------------------------------------------------------------ 9. --set on a resume: allowed or refused
def test_resume_applies_settings_that_leave_the_trained_steps_alone(
    run_overrides, tmp_path, monkeypatch, capsys
):
    sets = run_overrides()
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)
    out = tmp_path / "run"
    crash_after(monkeypatch, 2)  # after stage0-step000006
    with pytest.raises(Crash):
        distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
    monkeypatch.undo()
    capsys.readouterr()
    # the whole command typed again (unchanged values pass) with checkpoint and evaluation settings changed
    changes = [
        "stages.1.save_every=1",
        "stages.1.keep_checkpoints=20",
        "stages.2.keep_checkpoints=20",
        "stages.0.eval_every=2",
        "eval.max_tokens=256",
    ]
    distill(load_recipe(BASE_RECIPE, sets), out, resume=True, overrides=[*sets, *changes], progress=False)
    notice = [line for line in capsys.readouterr().err.splitlines() if line.startswith("--resume with --set")]
    assert notice == [
        "--resume with --set: stages.0.eval_every 4 → 2, stages.1.save_every 3 → 1, stages.1.keep_checkpoints 2 → 20, "
        "stages.2.keep_checkpoints 2 → 20, eval.max_tokens 512 → 256"
    ]
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    # what a later resume continues with
    assert saved["stages"][1]["save_every"] == 1 and saved["eval"]["max_tokens"] == 256
    assert [p.name for p in sorted((out / "checkpoints").glob("stage1-*"))] == [
        f"stage1-step{i:06d}" for i in range(1, 7)
    ]
    evaluated = [
        r["step"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["stage_index"] == 0 and "eval_loss" in r
    ]
    assert evaluated == [4, 8, 10, 12]  # every 4th step before the resume at 6, every 2nd after it
    assert_same_student(reference, out)  # none of it touched the math


def test_resume_refuses_a_setting_that_would_change_the_training(
    run_overrides, tmp_path, monkeypatch, capsys
):
    sets = run_overrides()
    out = tmp_path / "run"
    crash_after(monkeypatch, 1)
    with pytest.raises(Crash):
        distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
    monkeypatch.undo()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert (
        main(
            [
                "distill",
                "--out",
                str(out),
                "--resume",
                "--no-progress",
                "--set",
                "stages.0.tokens=3072",
                "--set",
                "eval.max_tokens=256",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: --set stages.0.tokens=3072 would change the recipe of the run being resumed (it has 1536) — "
    ), err
    assert "eval.*" in err[0] and "mixed_precision" in err[0]  # what may change
    with pytest.raises(ConfigError, match="--set teacher="):
        distill(
            load_recipe(BASE_RECIPE, sets),
            out,
            resume=True,
            overrides=["teacher=smollm2-135m"],
            progress=False,
        )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing on disk changed


# ------------------------------------------------------------- 10. a resume with no checkpoint to resume from
def test_a_resume_without_a_checkpoint_starts_the_metrics_afresh(run_overrides, tmp_path, monkeypatch):
    sets = run_overrides()
    out = tmp_path / "run"
    crash_after(monkeypatch, 2, "_log_step")  # two metric lines, no checkpoint yet (save_every 3)
    with pytest.raises(Crash):
        distill(load_recipe(BASE_RECIPE, sets), out, progress=False)
    monkeypatch.undo()
    assert _steps(out) == [(0, 1), (0, 2)] and latest_checkpoint(out) is None
    distill(load_recipe(BASE_RECIPE, sets), out, resume=True, progress=False)
    steps = _steps(out)
    assert len(steps) == len(set(steps)) == 21 and steps == sorted(steps)  # each step of each stage once


# ------------------------------------------------- 11, 12, 13. another process, what a killed run left, signals
SLOW_CLI = r"""
import os, sys, time
import attn2ssm.distill.run_dir as run_dir
import attn2ssm.distill.trainer as T
from attn2ssm.cli import main

HOLD = os.environ.get("ATTN2SSM_TEST_HOLD")
train_step, save_checkpoint = T.Distiller._train_step, T.Distiller._save_checkpoint

def slow_step(self, *args, **kwargs):  # time for the test to act mid-run; the math is untouched
    result = train_step(self, *args, **kwargs)
    time.sleep(0.3)
    return result

def held_save(self, *args, **kwargs):  # parked after the checkpoint, its lock held, while HOLD exists
    save_checkpoint(self, *args, **kwargs)
    deadline = time.monotonic() + 600  # (only a stray run's end: the test kills it long before)
    while os.path.exists(HOLD) and time.monotonic() < deadline:
        time.sleep(0.02)

if HOLD:
    T.Distiller._save_checkpoint = held_save
else:
    T.Distiller._train_step = slow_step
sys.exit(main(sys.argv[1:]))
"""


def _start_slow(out: Path, sets: list[str], hold: Path | None = None) -> subprocess.Popen:
    """``attn2ssm distill`` with slow steps, returned once its first metric line is written. With
    ``hold`` (a file the test made) its steps are not slowed: it parks after each checkpoint, holding
    its lock, for as long as that file exists."""
    args = [
        sys.executable,
        "-c",
        SLOW_CLI,
        "distill",
        BASE_RECIPE,
        "--out",
        str(out),
        "--no-progress",
        *sum((["--set", s] for s in sets), []),
    ]
    env = _env() if hold is None else {**_env(), "ATTN2SSM_TEST_HOLD": str(hold)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().endswith("\n")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run ended before its first step: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attn2ssm", *args], env=_env(), capture_output=True, text=True, timeout=600
    )


def test_a_second_run_on_the_same_out_is_refused_and_a_killed_run_leaves_no_lock_nor_temporaries(
    run_overrides, tmp_path
):
    sets = run_overrides()
    out = tmp_path / "run"
    hold = tmp_path / "hold"
    hold.touch()  # never removed: the first run holds the lock until it is killed, however slow the second
    first = _start_slow(out, sets, hold=hold)
    try:
        lines = (out / "metrics.jsonl").read_bytes()
        second = _run_cli(
            "distill",
            BASE_RECIPE,
            "--out",
            str(out),
            "--no-progress",
            *sum((["--set", s] for s in [*sets, "seed=1"]), []),
        )
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-2000:]
        err = second.stderr.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith(f"error: another process (pid {first.pid} on ")
            and f"is using {out} — " in err[0]
        ), err
        # the second run wrote nothing: only the first's lines
        assert (out / "metrics.jsonl").read_bytes().startswith(lines)
        deadline = time.monotonic() + 300
        while latest_checkpoint(out) is None:  # the kill lands where it is parked: its first checkpoint
            assert first.poll() is None, f"the first run ended: {first.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "the first run reached no checkpoint in 300 s"
            time.sleep(0.05)
        assert first.poll() is None
    finally:
        first.kill()  # SIGKILL: the OS drops its lock
        first.communicate()
    assert latest_checkpoint(out).name == "stage0-step000003"
    # as if killed while writing them
    for leftover in (
        out / ".tmp-student",
        out / "checkpoints" / ".tmp-stage0-step000009",
    ):
        leftover.mkdir(parents=True, exist_ok=True)
        (leftover / "model.safetensors").write_bytes(b"\0" * 4096)
    resumed = _run_cli("distill", "--out", str(out), "--resume", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert len(_steps(out)) == len(set(_steps(out))) == 21
    # the resume removed them
    assert not [p for p in [*out.iterdir(), *(out / "checkpoints").iterdir()] if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_command(
    signum, run_overrides, tmp_path
):
    sets = run_overrides()
    reference = tmp_path / "reference"
    distill(load_recipe(BASE_RECIPE, sets), reference, progress=False)

    out = tmp_path / "run"
    proc = _start_slow(out, sets)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, stderr[-2000:]  # 143 for SIGTERM, 130 for SIGINT
    assert "Traceback" not in stderr
    stage, step = _steps(out)[-1]
    assert stage == 0 and step < 12  # mid-stage, the step it was in finished and logged
    name = f"stage0-step{step:06d}"
    assert latest_checkpoint(out).name == name and damage(latest_checkpoint(out)) is None
    command = f"attn2ssm distill --out {out} --resume"
    assert stderr.strip().splitlines()[-1] == (
        f"stopped by {signal.Signals(signum).name} at stage 1/3 step {step}: checkpoint "
        f"{out / 'checkpoints' / name} — resume with: {command}"
    )
    assert not (out / "student").exists()

    resumed = _run_cli(*shlex.split(command)[1:], "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_student(reference, out)
    assert _steps(out) == _steps(reference)
