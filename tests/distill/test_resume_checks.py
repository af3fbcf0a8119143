"""What ``distill --resume`` reads back from a run directory, checked before any work, and a run
directory written before the trainer's carve resumed to the student its uninterrupted run gave.

``tests/fixtures/run_before_carve_f059a19.tar.xz`` holds, as attn2ssm f059a19 wrote them (the
commit before the trainer was carved into files; ``make_fixture.py`` inside says how): a tiny
random Llama teacher, a corpus, ``run/`` — a three-stage run (KD on a 50 % hybrid, stepwise growth
to 0 % attention, a LoRA stage) killed right after its first checkpoint — and ``reference/`` — the
final student of the same run uninterrupted. The recipe names teacher and corpus by paths relative
to the extracted folder.
"""

import json
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import attn2ssm.distill.trainer as T
from attn2ssm.cli import main
from attn2ssm.distill.recipe import load_recipe
from attn2ssm.distill.trainer import Distiller, distill
from attn2ssm.errors import ConfigError
from tiny_models import BASE_RECIPE, one_line_error

FIXTURE = Path(__file__).parents[1] / "fixtures" / "run_before_carve_f059a19.tar.xz"


@pytest.fixture
def saved_run(tmp_path, monkeypatch):
    """The fixture extracted into tmp_path, the working folder set there; returns the run folder."""
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(tmp_path, filter="data")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run"


def _files(folder: Path) -> dict:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def _steps(run: Path) -> list[tuple[int, int]]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [(r["stage_index"], r["step"]) for r in records if "loss" in r]


def test_a_run_saved_before_the_carve_resumes_to_its_uninterrupted_student(saved_run, capsys):
    # a last metrics line cut by the kill: dropped with one warning, and the resume goes on
    with open(saved_run / "metrics.jsonl", "a") as fh:
        fh.write('{"stage": "kd", "stage_index": 0, "step": 4, "lo')
    assert main(["distill", "--out", "run", "--resume", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl ends in a line cut by the kill" in err and "the resume drops it" in err
    assert _steps(saved_run) == [(0, s) for s in range(1, 7)] + [(1, 1), (1, 2), (2, 1), (2, 2)]
    reference = load_file(saved_run.parent / "reference" / "student" / "model.safetensors")
    resumed = load_file(saved_run / "student" / "model.safetensors")
    assert reference.keys() == resumed.keys()
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], atol=1e-6, rtol=1e-6, msg=name)


def test_a_malformed_saved_recipe_is_one_line_and_changes_nothing(saved_run, capsys):
    (saved_run / "recipe.yaml").write_text("teacher: ./teacher\nstages: [{name: kd\n")
    before = _files(saved_run)
    err = one_line_error(capsys, ["distill", "--out", "run", "--resume"])
    assert "run/recipe.yaml is not valid YAML at line 3 (damaged)" in err and "another --out" in err
    (saved_run / "recipe.yaml").write_bytes(b"\xff\xfe\x00garbage")
    err = one_line_error(capsys, ["distill", "--out", "run", "--resume"])
    assert "run/recipe.yaml is not text (damaged)" in err
    with pytest.raises(ConfigError, match="is not text"):  # the Python API alike
        distill(load_recipe(BASE_RECIPE), "run", resume=True, progress=False)
    assert _files(saved_run) == {**before, saved_run / "recipe.yaml": b"\xff\xfe\x00garbage"}


def test_random_bytes_in_the_metrics_log_are_one_line_and_change_nothing(saved_run, capsys):
    metrics = saved_run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b"\x8f\xa3\x00\xff random\n")
    before = _files(saved_run)
    err = one_line_error(capsys, ["distill", "--out", "run", "--resume"])
    assert "metrics.jsonl is damaged: line 4 is not text" in err and "move" in err
    metrics.write_bytes(b'{"step": 1}\nnot json\n{"step": 2}\n')
    err = one_line_error(capsys, ["distill", "--out", "run", "--resume"])
    assert "metrics.jsonl is damaged: line 2 is not a JSON record" in err
    assert {p: b for p, b in _files(saved_run).items() if p != metrics} == {
        p: b for p, b in before.items() if p != metrics
    }


def test_a_resume_naming_another_recipe_is_refused(saved_run, capsys):
    before = _files(saved_run)
    err = one_line_error(capsys, ["distill", "hybrid25", "--out", "run", "--resume"])
    assert "--resume: run holds a run of recipe 'base', not 'hybrid25'" in err
    assert "attn2ssm distill --out run --resume" in err and "another --out" in err
    assert _files(saved_run) == before


def test_resume_teacher_is_named_as_the_flag(saved_run, capsys):
    err = one_line_error(capsys, ["distill", "--out", "run", "--resume", "--teacher", "smollm2-135m"])
    assert "--resume --teacher smollm2-135m: the run in run was trained from teacher './teacher'" in err
    assert "--set" not in err


def test_a_mistyped_out_with_resume(run_overrides, tmp_path, capsys, monkeypatch):
    """The resume command (no recipe named) refuses a folder with no run; a named recipe starts
    there from scratch, saying so (a requeued job's first attempt)."""
    err = one_line_error(capsys, ["distill", "--out", str(tmp_path / "nope"), "--resume"])
    assert f"{tmp_path / 'nope'} holds no run to resume (no recipe.yaml)" in err
    assert "attn2ssm distill RECIPE --out" in err and not (tmp_path / "nope").exists()

    original = T.Distiller._log_step

    def stop_after_one(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(T.Distiller, "_log_step", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        distill(load_recipe(BASE_RECIPE, run_overrides()), tmp_path / "new", resume=True, progress=False)
    assert len(_steps(tmp_path / "new")) == 1  # it started
    assert (
        f"--resume: {tmp_path / 'new'} holds no run to resume (no recipe.yaml): starting 'base' from scratch"
        in (capsys.readouterr().err)
    )


def test_out_naming_a_file_is_one_line(run_overrides, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    sets = sum((["--set", s] for s in run_overrides()), [])
    for argv in (
        ["distill", BASE_RECIPE, "--out", str(target), *sets],
        ["distill", "--out", str(target), "--resume"],
    ):
        err = one_line_error(capsys, argv)
        assert f"--out {target} is a file, not a folder" in err
    assert target.read_text() == "mine"


def test_the_fsdp_config_on_a_cpu_says_it_runs_as_plain_data_parallel(
    run_overrides, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch --config_file fsdp.yaml sets
    distiller = Distiller(load_recipe(BASE_RECIPE, run_overrides()), tmp_path / "run", progress=False)
    distiller.close()
    notices = [line for line in capsys.readouterr().err.splitlines() if "FSDP" in line]
    assert notices == [
        "notice: the FSDP config does not shard on CPU: accelerate runs its 1 process(es) as plain data "
        "parallel, each holding the whole student and optimizer"
    ]
